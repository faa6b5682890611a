"""The phases of a training iteration, as a state machine with no torch in it.

The hook set (:mod:`.hooks`) turns what torch calls (module hooks, the
autograd engine, optimizer step hooks) into events here; a framework that knows
its phases says so with :meth:`PhaseMachine.begin` and :meth:`PhaseMachine.end`
(``MemoryProfiler.phase(name)``). From them the machine decides where the
iteration is:

- forward: the first module *of this model* entered with grad enabled from
  outside the model's other modules (the hook set's :mod:`.entries`). Entries one
  after the other before a backward (``self.encoder``, then ``self.decoder``) make
  one forward pass. Forwards under ``no_grad`` and checkpoint recomputation during
  backward are not a forward phase;
- backward: from when the gradient reaches a forward's outputs to when the
  autograd engine has finished the whole pass;
- optimizer step: the steps of optimizers that step this model's parameters. A
  step that runs a closure (``optimizer.step(closure)``: Lightning's automatic
  optimization, ``torch.optim.LBFGS``) holds forwards and backwards: they count as
  such, and the optimizer phase is the update, what runs after a closure's
  backward. What runs from the step's start to the closure's first forward is
  "other", and a step run from a gradient hook inside backward is backward's.

It counts passes and steps on every iteration. On a *watched* one (the
iteration's :class:`~.plan.IterationPlan` says so) it reads the counters at every
boundary (``read``, injected: the only device call it makes, through the meter's
counter) and hands the events to the plan's observers (:mod:`.observers`; an
:class:`EventRoutes` says which of them receives which event), each behind its own
fault-guard part; on the others it only follows the phase
(a backward's end is then noticed at the next forward, step or iteration end,
since nothing is queued on autograd's engine). In per-layer mode the
attribution's module hooks tell it where forward leaves and backward reaches a
tracked module (:meth:`PhaseMachine.module_left`,
:meth:`PhaseMachine.backward_reached`): more boundaries, so that each
interval's module is known.

Example::

    >>> from collections import namedtuple
    >>> from pytorch_mem_profiler.measure.plan import IterationPlan
    >>> Reading = namedtuple("Reading", "allocated peak_allocated reserved peak_reserved")
    >>> allocated = [0]
    >>> read = lambda: Reading(allocated[0], allocated[0], None, None)
    >>> class Pending:  # what the hook set puts on a forward's outputs: it tells when backward reaches them
    ...     started = False
    >>> machine = PhaseMachine(read, Pending, lambda: False)
    >>> machine.begin_iteration(IterationPlan.make("phases"))
    >>> machine.entered(True, (), None)           # a module of the model entered, grad enabled
    True
    >>> allocated[0] = 100; machine.left(machine.forward_pass)
    >>> machine.backward_started(()), machine.phase
    (True, 'backward')
    >>> machine.backward_finished(); machine.step_began(); machine.step_ended()
    >>> final, counts, phase_count, model_calls = machine.finish_iteration(model_running=False)
    >>> counts, phase_count, final.allocated
    ((1, 1, 1), {'forward': 1, 'backward': 1, 'optimizer': 1}, 100)
"""

from __future__ import annotations

from typing import Any, Callable

from ..faults import FaultGuard
from .observers import Observer
from .plan import IterationPlan

__all__ = ["PhaseMachine", "MarkedBackward", "ForwardPass", "EventRoutes", "EXPLICIT_PHASES", "check_phase_name"]

#: The phases a framework can mark itself (``MemoryProfiler.phase(name)``).
EXPLICIT_PHASES = ("forward", "backward", "optimizer")

#: What a machine follows before its first plan and after :meth:`PhaseMachine.release`: nothing
#: read, no observer held.
_RESTING = IterationPlan.make("light")


class ForwardPass:
    """A forward pass: from its first entry into the model to its last exit before a backward."""

    __slots__ = ("start", "end_allocated", "pending", "explicit")

    def __init__(self, start: Any, pending: Any, explicit: bool) -> None:
        #: the reading when it began; ``None`` on an iteration that is not watched
        self.start = start
        #: allocated at the last exit from the model (``None`` while none happened or not watched)
        self.end_allocated: int | None = None
        #: the hook set's token on its outputs: its ``started`` tells whether backward reached them
        self.pending = pending
        #: whether a framework marked it by hand
        self.explicit = explicit

    @property
    def kept(self) -> int | None:
        """What the pass left allocated, from its start to its last exit (``None``: not measured)."""
        if self.start is None or self.end_allocated is None:
            return None
        return self.end_allocated - self.start.allocated


def check_phase_name(phase: str) -> None:
    """``ValueError`` for a phase a framework cannot mark (one not in :data:`EXPLICIT_PHASES`)."""
    if phase not in EXPLICIT_PHASES:
        raise ValueError(f"phase name must be one of {', '.join(map(repr, EXPLICIT_PHASES))}: name={phase!r}")


#: ``(observer, its bound method)`` pairs: who receives one event.
_Listeners = tuple[tuple[Observer, Callable[..., None]], ...]


class EventRoutes:
    """Which observers receive each event of :data:`~.observers.EVENTS`: one tuple of
    ``(observer, its bound method)`` pairs per event, under the event's name, holding only the
    observers that handle it. Made once per plan, so that an event costs no lookup, and never
    changed once made (an observer switched off gives new routes, :meth:`without`).

    Args:
        observers: the observers, in the order they receive the events (:class:`~.plan.IterationPlan`).

    Example::

        >>> class Counter(Observer):
        ...     part = "counter"
        ...     def forward_began(self, args, entry): pass
        >>> counter, idle = Counter(), Observer()
        >>> routes = EventRoutes((counter, idle))
        >>> [o for o, _ in routes.forward_began] == [counter], routes.boundary
        (True, ())
        >>> routes.without(counter).forward_began, routes.without(counter).observers == (idle,)
        ((), True)
    """

    __slots__ = (
        "observers",
        "boundary",
        "forward_began",
        "forward_resumed",
        "inputs_seen",
        "forward_left",
        "forward_closed",
        "backward_started",
        "backward_finished",
    )

    def __init__(self, observers: tuple[Observer, ...] = ()) -> None:
        def listeners(event: str) -> _Listeners:
            return tuple((o, getattr(o, event)) for o in observers if o.overrides(event))

        self.observers = observers
        self.boundary = listeners("boundary")
        self.forward_began = listeners("forward_began")
        self.forward_resumed = listeners("forward_resumed")
        self.inputs_seen = listeners("inputs_seen")
        # popped in the reverse of the order they were pushed in
        self.forward_left = listeners("forward_left")[::-1]
        self.forward_closed = listeners("forward_closed")
        self.backward_started = listeners("backward_started")
        self.backward_finished = listeners("backward_finished")

    def without(self, observer: Observer) -> EventRoutes:
        """These routes with ``observer`` no longer on (a fault switched it off)."""
        return EventRoutes(tuple(o for o in self.observers if o is not observer))


#: Routes to no observer (an iteration not watched, a released machine): shared, as it never changes.
_NO_ROUTES = EventRoutes()


class _StepNesting:
    """The optimizer steps running. Steps nest (an optimizer whose step runs another's, as
    wrappers do) and count once; the forwards begun in the running step (its closure's) tell
    its set-up from its update; a step begun inside backward (per-parameter steps run from
    gradient hooks) is backward's."""

    __slots__ = ("depth", "forwards", "in_backward")

    def __init__(self) -> None:
        #: steps running, nested ones too (0: none)
        self.depth = 0
        #: forwards begun in the running step
        self.forwards = 0
        #: whether the running step began inside backward
        self.in_backward = False

    def clear(self) -> None:
        """No step runs (its hooks are off: one begun is never ended)."""
        self.depth = self.forwards = 0
        self.in_backward = False


class _BackwardWatch:
    """Whether a backward is looked for, and how its end is found on an iteration not watched,
    where nothing is queued on autograd's engine: its start was seen (``unsettled``), and it has
    ended once this thread is outside every backward graph (``running()`` is false)."""

    __slots__ = ("running", "unsettled", "off")

    def __init__(self, running: Callable[[], bool]) -> None:
        #: whether this thread runs inside a backward pass now
        self.running = running
        #: a backward began on an iteration not watched and its end is not noticed yet
        self.unsettled = False
        #: the hook set's backward hooks are off for good (a fault): no backward is looked for
        self.off = False


class MarkedBackward:
    """Per-layer mode where the plan reads backward at marks (:attr:`~.plan.IterationPlan.backward_marks`):
    the interval from the first mark to the second is read as a full split reads it, and named
    after the first mark's module only where it ends as it did then (at the second mark, or at
    backward's end where there is none) and the tracked modules' forwards ended in the same order
    as in the last forward whose backward was read at every module (a layer skipped then and run
    now would put its backward inside it); the rest of backward has no module.

    Example::

        >>> marked = MarkedBackward()
        >>> marked.exits = ["0", "1", "2"]; marked.read_fully()       # a forward, then backward read fully
        >>> marked.backward_began(("2", "1"))                         # the next: read at 2 and 1
        >>> marked.reached("2", ("2", "1"))                           # read there...
        True
        >>> marked.begin_exact("2", ("2", "1"))                       # ...and the interval begins
        >>> marked.reached("1", ("2", "1")), marked.ended(("2", "1"))  # it ends at 1: named after 2
        (True, '2')
    """

    __slots__ = ("begun", "pending", "closed_by_mark", "exits", "exits_read")

    def __init__(self) -> None:
        #: whether the interval read as a full split reads it began in this backward
        self.begun = False
        #: its module while it runs (named when it ends, if it ends as it did)
        self.pending: str | None = None
        #: whether the mark that ends it is the one that ended it then (None: not ended by a mark)
        self.closed_by_mark: bool | None = None
        #: the tracked modules' forward ends, in order: in the running forward, and in the last one
        #: whose backward was read at every module
        self.exits: list[str] = []
        self.exits_read: list[str] | None = None

    def read_fully(self) -> None:
        """Backward begins and is read at every module: how the model ran, kept."""
        self.exits_read = list(self.exits)

    def backward_began(self, marks: tuple[str, ...]) -> None:
        """Backward begins, read at ``marks`` (per-layer mode: a watched iteration): from its start
        where the first is ``""``."""
        self.begun = marks[0] == ""
        self.closed_by_mark = None
        self.pending = "" if self.begun else None

    def reached(self, name: str, marks: tuple[str, ...]) -> bool:
        """Backward reached the tracked module ``name``: whether it is read there. A module reached
        inside the interval that is not a mark leaves it no module."""
        if name not in marks:
            self.pending = None
            return False
        if self.pending is not None:
            self.closed_by_mark = len(marks) > 1 and name == marks[1]
        return True

    def begin_exact(self, name: str, marks: tuple[str, ...]) -> None:
        """After the read at ``name``: the interval read as a full split reads it begins there,
        at the first mark's first reach."""
        if name == marks[0] and not self.begun:
            self.begun = True
            self.pending = name

    def ended(self, marks: tuple[str, ...] | None) -> str | None:
        """The running interval (the one read as a full split reads it) ended: its module, or ``None``."""
        closes_exact = self.closed_by_mark if self.closed_by_mark is not None else len(marks or ()) == 1
        where = self.pending if closes_exact and self.exits == self.exits_read else None
        self.pending = self.closed_by_mark = None
        return where


class PhaseMachine:
    """Where the running iteration is, from the events the hook set reports; no torch in it.

    Args:
        read: reads the counters and starts a new peak interval (the counter's ``mark``).
        new_pending: makes the token the hook set puts on a forward's outputs (an object with
            a ``started`` flag, set once backward reaches them).
        backward_running: whether this thread runs inside a backward pass now.
        on_first_forward: called once, at the first forward.
        guard: contains the observers' faults (each under its own part).
    """

    def __init__(
        self,
        read: Callable[[], Any],
        new_pending: Callable[[], Any],
        backward_running: Callable[[], bool],
        on_first_forward: Callable[[], None] | None = None,
        guard: FaultGuard | None = None,
    ) -> None:
        self._read = read
        self._new_pending = new_pending
        self._on_first_forward = on_first_forward
        self._guard = guard or FaultGuard()
        #: the phase running now: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``"other"``
        self.phase = "other"
        #: the forward pass running (``None`` between passes)
        self.forward_pass: ForwardPass | None = None
        # the last forward pass's pending backward, until the next forward
        self._awaiting: Any = None
        self._step = _StepNesting()
        # phases a framework marked itself (begin/end)
        self._explicit: set[str] = set()
        # the module the running interval runs in (per-layer mode; "": the model's own code)
        self._location: str | None = None
        self._backward = _BackwardWatch(backward_running)
        #: passes and steps of the running iteration (counted whether watched or not)
        self.forward_passes = 0
        self.backward_passes = 0
        self.optimizer_steps = 0
        #: calls that entered the model from outside it, no-grad ones too (0: the model never ran)
        self.model_calls = 0
        #: occurrences of each phase on a watched iteration
        self.phase_count: dict[str, int] = {}
        self._plan = _RESTING
        # the plan's ``watched``, kept here: every event reads it
        self._watched = False
        # per-layer mode: backward read at the plan's marks
        self._marked = MarkedBackward()
        self._routes = _NO_ROUTES

    def read_from(self, read: Callable[[], Any]) -> None:
        """Read the counters with ``read`` from now on (the model moved to another device)."""
        self._read = read

    # -- the plan ------------------------------------------------------------------------------
    def begin_iteration(self, plan: IterationPlan) -> None:
        """The coming iteration follows ``plan`` (handed by the meter before it starts)."""
        if plan is self._plan:
            return
        self._plan = plan
        self._watched = plan.watched
        # An iteration not watched hands no event to anyone.
        self._routes = EventRoutes(plan.observers) if plan.watched else _NO_ROUTES

    def _tell(self, listeners: _Listeners, *args: Any) -> None:
        for observer, event in listeners:
            try:
                event(*args)
            except Exception as exc:  # noqa: BLE001 - the observer switches off, the rest goes on
                self._failed(observer, exc)

    def _failed(self, observer: Observer, exc: Exception) -> None:
        """An observer's event raised: it switches off (the others go on); one without a part of
        its own (the phase intervals) passes the fault on to the hook that fired."""
        part = observer.part
        if part is None:
            raise exc
        self._routes = self._routes.without(observer)
        try:
            observer.on_fault()
        finally:
            self._guard.fault(part, exc)

    # -- boundaries ----------------------------------------------------------------------------
    def _mark(self, following: str, location: str | None = None) -> Any:
        """Read the counters, close the running interval and open one of phase ``following``
        (equal to the running phase: split at a module boundary) run in ``location``."""
        reading = self._read()
        ended, where = self.phase, self._location
        if self._marked.pending is not None:
            where = self._marked.ended(self._plan.backward_marks)
        for observer, boundary in self._routes.boundary:
            try:
                boundary(reading, ended, following, where)
            except Exception as exc:  # noqa: BLE001 - the observer switches off, the rest goes on
                self._failed(observer, exc)
        self.phase = following
        self._location = location
        return reading

    def _switch(self, following: str, location: str | None = None) -> Any:
        """A phase boundary: read it (:meth:`_mark`) on a watched iteration; on the others only
        note the phase, and give ``None``."""
        if self._watched:
            return self._mark(following, location)
        self.phase = following
        return None

    def _count(self, phase: str) -> None:
        counts = self.phase_count
        counts[phase] = counts.get(phase, 0) + 1

    def module_left(self, ended_in: str, now_in: str) -> None:
        """A tracked module's forward ended (per-layer mode): what ran since the last boundary is
        put down to ``ended_in``; the code runs in ``now_in`` from here."""
        if self.phase == "forward":
            self._marked.exits.append(ended_in)
        if self.phase == "forward" and self._plan.split_forward:
            self._location = ended_in
            self._mark("forward", now_in)

    def backward_reached(self, name: str) -> None:
        """Backward reached the outputs of the tracked module ``name`` (per-layer mode): read at
        each such module, or only at the plan's :attr:`~.plan.IterationPlan.backward_marks`, where
        the interval from the first to the second is read as a full split reads it (and named
        after the first where no other tracked module was reached in it and it ended at the
        second) and the rest has no module."""
        if self.phase == "backward" and self._watched:
            marks = self._plan.backward_marks
            if marks is None:
                self._mark("backward", name)
            else:
                marked = self._marked
                if marked.reached(name, marks):
                    self._mark("backward", None)
                    marked.begin_exact(name, marks)

    def _open_backward(self, boundary: Callable[..., Any]) -> None:
        """Backward begins: ``boundary`` (:meth:`_mark` or :meth:`_switch`) opens its first interval,
        run in ``""`` (no tracked module) in per-layer mode; where the plan reads backward at marks,
        in no module (``None``), unless it peaked there when fully read (then ``""`` once it ends
        where it did)."""
        plan = self._plan
        if not plan.per_layer:
            boundary("backward", None)
        elif plan.backward_marks is None:
            boundary("backward", "")
            # only a backward read at every module says how the model ran then (a "phases"
            # iteration between two per-layer ones reads no module and keeps no order)
            self._marked.read_fully()
        else:
            boundary("backward", None)
            self._marked.backward_began(plan.backward_marks)

    # -- forward ---------------------------------------------------------------------------------
    def entered(self, grad_enabled: bool, args: Any, entry: Any) -> bool:
        """A call entered the model from outside it (through module ``entry``, with ``args``): is
        it (part of) a training forward? No-grad forwards (evaluation) and recomputation inside
        backward leave nothing for a later backward: they are not a forward phase."""
        self.model_calls += 1
        if self._backward.unsettled:
            self._settle_backward()
        if not grad_enabled or self.phase == "backward":
            return False
        if "forward" in self._explicit:
            # The framework marked this forward: only learn the inputs.
            listeners = self._routes.inputs_seen
            if listeners:
                self._tell(listeners, args)
            return True
        self._begin_forward(args, entry)
        return True

    def left(self, pass_: ForwardPass) -> None:
        """A training forward's call into the model returned (``pass_``: the running pass)."""
        if "forward" not in self._explicit:
            self._leave(pass_)

    def _begin_forward(self, args: Any, entry: Any, explicit: bool = False) -> None:
        pass_, step = self.forward_pass, self._step
        location = "" if self._plan.split_forward else None
        if pass_ is not None and not explicit and not pass_.explicit and not pass_.pending.started:
            # Entered again before any backward (self.decoder after self.encoder): the same pass.
            self._switch("forward", location)
            listeners = self._routes.forward_resumed
            if listeners:
                self._tell(listeners, args, entry)
        else:
            if pass_ is not None:
                self._close_forward()
            if step.depth and not step.forwards and self.phase == "optimizer":
                # From the step's start to its closure's first forward is not the update.
                self.phase = "other"
            if self._on_first_forward is not None:
                callback, self._on_first_forward = self._on_first_forward, None
                callback()
            if self._watched:
                self._marked.exits = []
                start = self._mark("forward", location)
                self._count("forward")
            else:  # the light path: only the phase and the count
                self.phase, start = "forward", None
            self.forward_pass = ForwardPass(start, self._new_pending(), explicit)
            self.forward_passes += 1
            listeners = self._routes.forward_began
            if listeners:
                self._tell(listeners, args, entry)
        if step.depth:
            step.forwards += 1

    def _leave(self, pass_: ForwardPass) -> None:
        """The model was left: the pass may go on (another entry) or end (backward, a step)."""
        listeners = self._routes.forward_left
        if listeners:
            self._tell(listeners)
        if self.phase == "forward":
            reading = self._switch("other")
            if reading is not None and pass_.start is not None:
                pass_.end_allocated = reading.allocated

    def _close_forward(self) -> None:
        """End the forward pass for good."""
        pass_, self.forward_pass = self.forward_pass, None
        if pass_ is None:
            return
        self._awaiting = pass_.pending
        self._leave(pass_)  # still inside it when a phase marked by hand ends it
        listeners = self._routes.forward_closed
        if listeners:
            self._tell(listeners, pass_.kept)

    # -- backward ----------------------------------------------------------------------------------
    def backward_started(self, grad_outputs: Any) -> bool:
        """The gradient reached a forward's outputs; whether the hook set must queue backward's
        end on autograd's engine (a watched iteration: :meth:`backward_finished`)."""
        if "backward" in self._explicit or self.phase == "backward":
            return False  # marked by the framework, or a second forward's outputs in the same backward
        pass_ = self.forward_pass
        if pass_ is not None and pass_.start is None and self.phase != "forward":
            self.forward_pass, self._awaiting = None, pass_.pending  # as _close_forward does, the pass left already
        else:
            self._close_forward()
        if not self._watched:
            # Counted and left when noticed ended (_settle_backward): nothing queued on the
            # engine, no gradient sizes, no hand-over to autograd's device thread.
            self.phase = "backward"
            self._backward.unsettled = True
            return False
        self._open_backward(self._mark)
        self._count("backward")
        listeners = self._routes.backward_started
        if listeners:
            self._tell(listeners, grad_outputs)
        return True

    def backward_finished(self) -> None:
        """The whole backward pass is done (autograd's engine ran the callback queued at its start)."""
        # Inside an optimizer step (a closure), what follows backward is the update.
        step = self._step
        end = self._switch("optimizer" if step.depth and not step.in_backward else "other")
        self.backward_passes += 1
        if end is not None:
            listeners = self._routes.backward_finished
            if listeners:
                self._tell(listeners)

    def _settle_backward(self) -> None:
        """On an iteration not watched, a backward whose start was seen has ended once this
        thread is outside every backward graph: count it and leave its phase."""
        backward = self._backward
        if not backward.unsettled or backward.running():
            return
        backward.unsettled = False
        self.backward_passes += 1
        if self.phase == "backward":
            step = self._step
            self.phase = "optimizer" if step.depth and not step.in_backward else "other"

    # -- optimizer step ------------------------------------------------------------------------------
    def step_began(self) -> None:
        """An optimizer step over the model's parameters began (its pre-hook, or a framework's mark)."""
        if "optimizer" in self._explicit:
            return  # the framework marked this step
        if self._backward.unsettled:
            self._settle_backward()
        step = self._step
        step.depth += 1
        if step.depth > 1:
            return
        step.forwards = 0
        # A step run from a gradient hook inside backward (per-parameter steps) is part of backward.
        step.in_backward = self.phase == "backward"
        if not step.in_backward:
            if self.forward_pass is not None:
                self._close_forward()
            if self._watched:
                self._mark("optimizer")
            else:
                self.phase = "optimizer"

    def step_ended(self) -> None:
        """An optimizer step over the model's parameters ended (its post-hook, or a framework's mark)."""
        step = self._step
        if "optimizer" in self._explicit or step.depth == 0:
            return
        step.depth -= 1
        if step.depth:
            return
        self.optimizer_steps += 1
        if step.in_backward:
            step.in_backward = False
            return
        if self._watched:
            self._mark("other")
            self._count("optimizer")
        else:
            self.phase = "other"

    # -- phases a framework marks itself -----------------------------------------------------------------
    def begin(self, phase: str) -> str | None:
        """A framework says ``phase`` (``"forward"``, ``"backward"`` or ``"optimizer"``) starts now.

        Returns a token for :meth:`end`; ``None`` when that phase was already marked as
        running (the inner mark is then ignored). The automatic hooks that fire inside
        the phase do not open a second one.
        """
        check_phase_name(phase)
        if phase in self._explicit:
            return None
        if self._backward.unsettled:
            self._settle_backward()
        if phase == "forward":
            self._begin_forward((), None, explicit=True)
        elif phase == "backward":
            self._close_forward()
            self._open_backward(self._switch)
            self._count("backward")
        else:
            self.step_began()
        self._explicit.add(phase)
        return phase

    def end(self, token: str | None) -> None:
        """The phase :meth:`begin` returned ``token`` for has ended."""
        if token is None or token not in self._explicit:
            return
        self._explicit.discard(token)
        if token == "forward":
            self._close_forward()
        elif token == "backward":
            if self.phase == "backward":
                self.backward_finished()
        else:
            self.step_ended()  # no longer marked: it ends

    # -- between iterations ----------------------------------------------------------------------------
    def at_rest(self) -> bool:
        """Whether nothing is open that the hooks must see end: no forward awaiting its
        backward, no backward, no step, no phase marked by hand (the hooks may sleep)."""
        if self.forward_pass is not None or self._step.depth or self._explicit:
            return False
        awaiting, backward = self._awaiting, self._backward
        if awaiting is not None and not awaiting.started and not backward.off:
            return False  # the last forward's backward is still to come: it must be found
        return not backward.unsettled and self.phase != "backward"

    def rest(self) -> None:
        """The hooks went to sleep: nothing runs until they wake."""
        self.phase = "other"

    def quiet(self) -> bool:
        """Whether no event came in this iteration (the hooks slept through it, and no phase was
        marked by hand): it is closed by one read, and nothing else."""
        return not (
            self._explicit
            or self.forward_pass is not None
            or self._step.depth
            or self.forward_passes
            or self.backward_passes
            or self.optimizer_steps
        )

    def finish_iteration(self, model_running: bool) -> tuple[Any, tuple[int, int, int], dict[str, int], int]:
        """``record_stats()`` closes the iteration: a backward not watched is counted, a forward left
        for good (unless a framework marked it, or the model still runs) is closed, and the
        counters are read once more: the last boundary of a watched iteration (the running
        phase goes on), the one read of the others. Gives (that reading, (forward passes,
        backward passes, optimizer steps), occurrences of each phase, calls into the model),
        and starts counting the next iteration."""
        if self._backward.unsettled:
            self._settle_backward()
        pass_ = self.forward_pass
        if pass_ is not None and not pass_.explicit and not model_running:
            self._close_forward()
        final = self._mark(self.phase) if self._watched else self._read()
        done = final, (self.forward_passes, self.backward_passes, self.optimizer_steps), self.phase_count, self.model_calls
        self.forward_passes = self.backward_passes = self.optimizer_steps = self.model_calls = 0
        if self.phase_count:
            self.phase_count = {}
        return done

    # -- parts switched off --------------------------------------------------------------------------------
    def forward_switched_off(self) -> None:
        """The forward hooks are off for good: the running pass never closes now, and its
        backward is never looked for."""
        self.forward_pass = self._awaiting = None
        if self.phase == "forward":
            self.phase = "other"

    def steps_switched_off(self) -> None:
        """The optimizer-step hooks are off for good: a step begun is never ended."""
        self._step.clear()
        if self.phase == "optimizer":
            self.phase = "other"

    def backward_switched_off(self) -> None:
        """The backward hooks are off for good: no backward is looked for or awaited."""
        backward = self._backward
        backward.off = True
        self._awaiting = None
        backward.unsettled = False
        if self.phase == "backward":
            self.phase = "other"

    def hooks_removed(self) -> None:
        """Every hook is off (``remove()``): nothing of a forward is awaited any more."""
        self.forward_pass = self._awaiting = None

    def release(self) -> None:
        """Drop every callable and observer given (a closed profiler is freed at once)."""
        self._on_first_forward = None
        self._new_pending = _no_pending
        self._plan = _RESTING
        self._routes = _NO_ROUTES
        self.forward_pass = self._awaiting = None


class _NoPending:
    started = True


def _no_pending() -> Any:
    return _NoPending()
