"""Vision models held back from the zoo: the same checks on models the zoo was not tuned on.

:data:`HOLDOUT_VISION` (name -> :class:`~benchmarks.zoo.registry.ZooModel`) holds vision models of
families the zoo (:data:`~benchmarks.zoo.registry.ZOO`) does not have, each built by its library's
own constructor (``weights=None``, ``pretrained=False``: nothing downloaded) at a small size for the
CPU tests (``tests/test_zoo_holdout_vision.py``) and a realistic one for the GPU
(``tests/test_zoo_holdout_vision_cuda.py``). They cover concatenation-heavy DenseNet, channel
shuffles, fire modules, inception branches, RegNet's grouped bottlenecks with squeeze-excitation,
MNASNet, MobileNetV3-Small, ResNeXt, torchvision's ViT (``nn.MultiheadAttention``) and Swin V2
(cosine attention, a continuous position-bias MLP), segmentation heads (dilated convolutions,
interpolation, dict outputs), RAFT optical flow (a correlation volume, ``grid_sample``, twelve
recurrent refinements), Faster R-CNN (refused: its boxes decide shapes), timm's distilled DeiT (two heads), LeViT (BatchNorm inside attention,
gathered attention biases), ResMLP and MLP-Mixer, PoolFormer, NF-ResNet (weight standardisation
in every forward), MobileViT, EfficientFormer, FastViT, ConViT (a buffer replaced in forward), EVA-02
(q and v biases concatenated), PVT-v2 (layer norms over permuted tokens); and plain-torch models: a 3D-convolution
video net, a generator with transposed convolutions, ``PixelShuffle``, ``GroupNorm`` and
``InstanceNorm``, and a channels-last CNN.

Example::

    >>> from benchmarks.zoo.holdout_vision import HOLDOUT_VISION
    >>> entry = HOLDOUT_VISION["video3d"]
    >>> entry.family, entry.setup
    ('video', 'AdamW, bf16 autocast')
    >>> out = entry.builder("small")()(entry.inputs("small")(2))
    >>> float(entry.loss(out, entry.targets("small")(2))) > 0
    True
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .registry import ADAMW, SGD_MOMENTUM, ZOO, ZooModel, _class_targets, _images, _num_classes, class_loss

__all__ = ["HOLDOUT_VISION"]

# -- losses and inputs beyond the zoo's --------------------------------------------------------


def segmentation_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Per-pixel cross-entropy on ``output["out"]`` (torchvision's segmentation models return a dict)."""
    return F.cross_entropy(output["out"].float(), labels)


def distilled_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Both heads of a distilled model in training (class token and distillation token), as DeiT trains."""
    logits, distilled = output
    return 0.5 * (F.cross_entropy(logits.float(), labels) + F.cross_entropy(distilled.float(), labels))


def reconstruction_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


SEGMENT_IMAGE = {"small": 32, "real": 256}
SEGMENT_CLASSES = {"small": 3, "real": 21}


def _masks(size: str, batch: int) -> torch.Tensor:
    side = SEGMENT_IMAGE[size]
    return torch.randint(0, SEGMENT_CLASSES[size], (batch, side, side))


VIDEO_SHAPE = {"small": (4, 16), "real": (16, 112)}  # frames, side


def _clips(size: str, batch: int) -> torch.Tensor:
    frames, side = VIDEO_SHAPE[size]
    return torch.randn(batch, 3, frames, side, side)


GENERATOR_IMAGE = {"small": 16, "real": 256}


def _generator_targets(size: str, batch: int) -> torch.Tensor:
    side = GENERATOR_IMAGE[size]
    return torch.rand(batch, 3, side, side) * 2 - 1


def _channels_last_images(image: dict[str, int]) -> Callable[[str, int], torch.Tensor]:
    return lambda size, batch: torch.randn(batch, 3, image[size], image[size]).contiguous(memory_format=torch.channels_last)


# -- torchvision ---------------------------------------------------------------------------------


def densenet(size: str) -> nn.Module:
    import torchvision
    from torchvision.models import DenseNet

    if size == "small":  # two dense blocks of growth 8: every layer concatenates all before it
        return DenseNet(growth_rate=8, block_config=(3, 3), num_init_features=16, bn_size=2, num_classes=10)
    return torchvision.models.densenet121(weights=None)


def shufflenet(size: str) -> nn.Module:
    import torchvision
    from torchvision.models import ShuffleNetV2

    if size == "small":
        return ShuffleNetV2([1, 1, 1], [8, 16, 32, 64, 128], num_classes=10)
    return torchvision.models.shufflenet_v2_x1_0(weights=None)


def squeezenet(size: str) -> nn.Module:
    import torchvision

    return torchvision.models.squeezenet1_1(weights=None, num_classes=_num_classes(size))


def googlenet(size: str) -> nn.Module:
    import torchvision

    return torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False, num_classes=_num_classes(size))


def regnet(size: str) -> nn.Module:
    import torchvision
    from torchvision.models.regnet import BlockParams, RegNet

    if size == "small":  # grouped bottlenecks with squeeze-excitation, as regnet_y_* build them
        params = BlockParams.from_init_params(depth=4, w_0=8, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
        return RegNet(params, num_classes=10, stem_width=8)
    return torchvision.models.regnet_y_400mf(weights=None)


def mnasnet(size: str) -> nn.Module:
    import torchvision

    if size == "small":
        return torchvision.models.MNASNet(0.25, num_classes=10)
    return torchvision.models.mnasnet1_0(weights=None)


def mobilenet_small(size: str) -> nn.Module:
    import torchvision

    return torchvision.models.mobilenet_v3_small(weights=None, num_classes=_num_classes(size))


def resnext(size: str) -> nn.Module:
    import torchvision
    from torchvision.models.resnet import Bottleneck, ResNet

    if size == "small":  # 4 groups of width 4 in each bottleneck's 3x3
        return ResNet(Bottleneck, [1, 1, 1, 1], groups=4, width_per_group=4, num_classes=10)
    return torchvision.models.resnext50_32x4d(weights=None)


def tv_vit(size: str) -> nn.Module:
    import torchvision
    from torchvision.models import VisionTransformer

    if size == "small":
        return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10)
    return torchvision.models.vit_b_16(weights=None)


def tv_swin_v2(size: str) -> nn.Module:
    import torchvision
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2

    if size == "small":
        return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=[4, 4],
                               stochastic_depth_prob=0.1, num_classes=10, block=SwinTransformerBlockV2,
                               downsample_layer=PatchMergingV2)
    return torchvision.models.swin_v2_t(weights=None)


def deeplabv3(size: str) -> nn.Module:
    from torchvision.models import segmentation

    if size == "small":  # deeplabv3_mobilenet_v3_large's parts, narrower: a dilated backbone, ASPP with its pooling branch
        from torchvision.models import mobilenet_v3_large
        from torchvision.models._utils import IntermediateLayerGetter
        from torchvision.models.segmentation.deeplabv3 import ASPP, DeepLabV3

        features = mobilenet_v3_large(weights=None, width_mult=0.25, dilated=True).features
        backbone = IntermediateLayerGetter(features, return_layers={str(len(features) - 1): "out"})
        head = nn.Sequential(ASPP(features[-1].out_channels, [2, 4, 6], out_channels=16), nn.Conv2d(16, 16, 3, padding=1, bias=False),
                             nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, SEGMENT_CLASSES[size], 1))
        return DeepLabV3(backbone, head)
    return segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=SEGMENT_CLASSES[size])


def lraspp(size: str) -> nn.Module:
    from torchvision.models import segmentation

    return segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=SEGMENT_CLASSES[size])


def faster_rcnn(size: str) -> nn.Module:
    from torchvision.models import detection

    build = detection.fasterrcnn_mobilenet_v3_large_320_fpn if size == "small" else detection.fasterrcnn_mobilenet_v3_large_fpn
    return build(weights=None, weights_backbone=None, num_classes=DETECTION_CLASSES)


DETECTION_IMAGE = {"small": 64, "real": 512}
DETECTION_CLASSES = 5


def _detection_batch(size: str, batch: int) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Images and their boxes, as torchvision's detection models take them in training."""
    side = DETECTION_IMAGE[size]
    corners = torch.rand(batch, 2, 2) * side / 2
    boxes = torch.cat([corners[:, 0], corners[:, 0] + corners[:, 1] + side / 8], dim=1)[:, None]
    targets = [{"boxes": boxes[i], "labels": torch.randint(1, DETECTION_CLASSES, (1,))} for i in range(batch)]
    return [torch.rand(3, side, side) for _ in range(batch)], targets


def _no_targets(size: str, batch: int) -> tuple[()]:
    return ()  # the boxes go in with the images


def detection_loss(output: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sum of a torchvision detection model's losses (classifier, box regression, objectness, RPN boxes)."""
    return sum(output.values())  # type: ignore[return-value]


def raft(size: str) -> nn.Module:
    import torchvision

    return torchvision.models.optical_flow.raft_small(weights=None)


FLOW_IMAGE = {"small": (128, 128), "real": (368, 496)}  # at least 128: the correlation pyramid's four levels


def _frame_pairs(size: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(batch, 3, *FLOW_IMAGE[size]) * 2 - 1, torch.rand(batch, 3, *FLOW_IMAGE[size]) * 2 - 1


def _flows(size: str, batch: int) -> torch.Tensor:
    return torch.randn(batch, 2, *FLOW_IMAGE[size])


def flow_sequence_loss(predictions: list[torch.Tensor], flow: torch.Tensor, gamma: float = 0.8) -> torch.Tensor:
    """RAFT's loss: the L1 error of every refinement's flow, later ones weighted more."""
    count = len(predictions)
    return sum(gamma ** (count - i - 1) * (p - flow).abs().mean() for i, p in enumerate(predictions))  # type: ignore[return-value]


# -- timm ----------------------------------------------------------------------------------------


def deit_distilled(size: str) -> nn.Module:
    import timm

    if size == "small":
        model = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                                  embed_dim=32, num_heads=2, num_classes=10, drop_path_rate=0.1)
    else:
        model = timm.create_model("deit_small_distilled_patch16_224", pretrained=False, drop_path_rate=0.1)
    model.set_distilled_training(True)  # training returns both heads' logits
    return model


def levit(size: str) -> nn.Module:
    import timm

    if size == "small":
        return timm.create_model("levit_128s", pretrained=False, img_size=64, embed_dim=(32, 48), key_dim=8, depth=(1, 1),
                                 num_heads=(2, 3), num_classes=10)
    return timm.create_model("levit_128s", pretrained=False)


def resmlp(size: str) -> nn.Module:
    import timm

    if size == "small":
        from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock

        # resmlp_12_224's layers (its factory fixes the patch size and depth)
        return MlpMixer(img_size=32, patch_size=8, num_blocks=2, embed_dim=32, mlp_ratio=4, block_layer=ResBlock, norm_layer=Affine,
                        num_classes=10)
    return timm.create_model("resmlp_12_224", pretrained=False)


def mixer(size: str) -> nn.Module:
    import timm

    if size == "small":
        from timm.models.mlp_mixer import MlpMixer

        return MlpMixer(img_size=32, patch_size=8, num_blocks=2, embed_dim=32, num_classes=10, drop_path_rate=0.1)
    return timm.create_model("mixer_b16_224", pretrained=False, drop_path_rate=0.1)


def poolformer(size: str) -> nn.Module:
    import timm

    if size == "small":
        from timm.models.metaformer import GroupNorm1, MetaFormer

        # poolformer_s12's layers (its factory fixes the depths and widths)
        return MetaFormer(depths=(1, 1, 1, 1), dims=(16, 24, 32, 48), downsample_norm=None, mlp_act=nn.GELU, mlp_bias=True,
                          norm_layers=GroupNorm1, layer_scale_init_values=1e-5, res_scale_init_values=None, use_mlp_head=False,
                          num_classes=10)
    return timm.create_model("poolformer_s12", pretrained=False, drop_path_rate=0.1)


def nf_resnet(size: str) -> nn.Module:
    import timm
    from timm.models.nfnet import NfCfg, NormFreeNet

    if size == "small":  # scaled weight-standardised convolutions: the weights normalised in every forward
        cfg = NfCfg(depths=(1, 1, 1, 1), channels=(16, 32, 64, 128), stem_chs=16, bottle_ratio=0.25, act_layer="relu",
                    stem_type="7x7_pool", group_size=None, attn_layer=None)
        return NormFreeNet(cfg, num_classes=10)
    return timm.create_model("nf_resnet50", pretrained=False)


def mobilevit(size: str) -> nn.Module:
    import timm

    name = "mobilevit_xxs" if size == "small" else "mobilevit_s"
    return timm.create_model(name, pretrained=False, num_classes=_num_classes(size))


def efficientformer(size: str) -> nn.Module:
    import timm

    if size == "small":
        return timm.create_model("efficientformer_l1", pretrained=False, depths=(1, 1, 1, 2), embed_dims=(16, 24, 32, 48),
                                 num_vit=1, num_classes=10)  # attention biases fixed at 7x7: 224x224 inputs
    return timm.create_model("efficientformer_l1", pretrained=False, drop_path_rate=0.1)


def fastvit(size: str) -> nn.Module:
    import timm

    if size == "small":  # the last stage attends (fastvit_sa*), the others mix by reparameterisable convolutions
        return timm.create_model("fastvit_sa12", pretrained=False, layers=(1, 1, 1, 1), embed_dims=(16, 32, 64, 128), num_classes=10)
    return timm.create_model("fastvit_sa12", pretrained=False, drop_path_rate=0.1)


def convit(size: str) -> nn.Module:
    import timm

    if size == "small":  # gated positional self-attention: relative positions built (a buffer replaced) at the first forward
        return timm.create_model("convit_tiny", pretrained=False, img_size=32, patch_size=8, embed_dim=32, num_heads=4, depth=2,
                                 local_up_to_layer=1, num_classes=10)
    return timm.create_model("convit_tiny", pretrained=False, drop_path_rate=0.1)


def eva02(size: str) -> nn.Module:
    import timm

    if size == "small":  # q and v biases concatenated around zeros: their gradients share one storage
        return timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32, num_heads=2,
                                 depth=2, num_classes=10)
    # the small EVA-02 is made for masked image modelling: without num_classes its head is an identity
    return timm.create_model("eva02_small_patch14_224", pretrained=False, drop_path_rate=0.1, num_classes=_num_classes(size))


def pvt_v2(size: str) -> nn.Module:
    import timm

    if size == "small":  # spatial-reduction attention; each stage ends in a layer norm, permuted back to NCHW
        return timm.create_model("pvt_v2_b0", pretrained=False, depths=(1, 2, 1, 1), embed_dims=(16, 32, 48, 64),
                                 num_heads=(1, 2, 3, 4), num_classes=10)
    return timm.create_model("pvt_v2_b1", pretrained=False, drop_path_rate=0.1)


# -- plain torch ---------------------------------------------------------------------------------


class VideoNet(nn.Module):
    """A C3D-style clip classifier: ``Conv3d`` + ``BatchNorm3d`` stages, ``MaxPool3d``, global pooling."""

    def __init__(self, width: int = 8, stages: int = 3, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for i in range(stages):
            c_out = width * 2**i
            layers += [nn.Conv3d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm3d(c_out), nn.ReLU(inplace=True),
                       nn.MaxPool3d((1, 2, 2) if i == 0 else 2)]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool3d(self.features(clips), 1).flatten(1))


class Generator(nn.Module):
    """An image-to-image generator: strided convolutions with ``GroupNorm`` down, ``InstanceNorm2d``
    residual blocks, ``ConvTranspose2d`` then ``PixelShuffle`` up, ``tanh`` out."""

    def __init__(self, width: int = 8, blocks: int = 2) -> None:
        super().__init__()
        self.down = nn.Sequential(
            nn.Conv2d(3, width, 7, padding=3), nn.GroupNorm(4, width), nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.GroupNorm(4, 2 * width), nn.ReLU(inplace=True),
            nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1), nn.GroupNorm(4, 4 * width), nn.ReLU(inplace=True),
        )
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(4 * width, 4 * width, 3, padding=1, padding_mode="reflect"), nn.InstanceNorm2d(4 * width, affine=True),
                          nn.LeakyReLU(0.2), nn.Conv2d(4 * width, 4 * width, 3, padding=1), nn.InstanceNorm2d(4 * width))
            for _ in range(blocks)
        )
        self.up = nn.Sequential(
            nn.ConvTranspose2d(4 * width, 2 * width, 4, stride=2, padding=1), nn.InstanceNorm2d(2 * width, affine=True), nn.ReLU(inplace=True),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1), nn.PixelShuffle(2), nn.ReLU(inplace=True),
            nn.Conv2d(width, 3, 7, padding=3),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.down(images)
        for block in self.blocks:
            x = x + block(x)
        return torch.tanh(self.up(x))


class ChannelsLastCNN(nn.Module):
    """A residual CNN whose weights and activations are channels-last (NHWC), as mixed-precision
    training on tensor cores keeps them."""

    def __init__(self, width: int = 16, stages: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        self.stages = nn.ModuleList()
        c = width
        for _ in range(stages):
            self.stages.append(nn.ModuleDict({
                "body": nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * c), nn.ReLU(inplace=True),
                                      nn.Conv2d(2 * c, 2 * c, 3, padding=1, bias=False), nn.BatchNorm2d(2 * c)),
                "skip": nn.Sequential(nn.Conv2d(c, 2 * c, 1, stride=2, bias=False), nn.BatchNorm2d(2 * c)),
            }))
            c *= 2
        self.head = nn.Linear(c, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for stage in self.stages:
            x = F.relu(stage["body"](x) + stage["skip"](x))
        return self.head(x.mean((2, 3)))


def video3d(size: str) -> nn.Module:
    return VideoNet(width=8, stages=3, classes=10) if size == "small" else VideoNet(width=64, stages=4, classes=400)


def _video_targets(size: str, batch: int) -> torch.Tensor:
    return torch.randint(0, 10 if size == "small" else 400, (batch,))


def generator(size: str) -> nn.Module:
    return Generator(width=8, blocks=2) if size == "small" else Generator(width=64, blocks=6)


def channels_last_cnn(size: str) -> nn.Module:
    model = ChannelsLastCNN(width=16, stages=3, classes=10) if size == "small" else ChannelsLastCNN(width=64, stages=4, classes=1000)
    return model.to(memory_format=torch.channels_last)


def _entries() -> list[ZooModel]:
    image = {"small": 32, "real": 224}
    image64 = {"small": 64, "real": 224}
    tv, tm = ("torchvision",), ("timm",)
    return [
        ZooModel("densenet", "CNN", "torchvision DenseNet-121 (growth 8, two blocks at the small size): every layer concatenates all before it",
                 densenet, _images(image), _class_targets, class_loss, SGD_MOMENTUM, None, {"small": 2, "real": 32}, tv),
        ZooModel("shufflenet_v2", "CNN", "torchvision ShuffleNetV2 x1.0: channel split, concatenation and shuffle (transpose + view)",
                 shufflenet, _images(image), _class_targets, class_loss, ADAMW, torch.bfloat16, {"small": 2, "real": 128}, tv),
        ZooModel("squeezenet", "CNN", "torchvision SqueezeNet 1.1: fire modules (1x1 and 3x3 expands concatenated), ceil-mode pooling, dropout",
                 squeezenet, _images(image64), _class_targets, class_loss, SGD_MOMENTUM, None, {"small": 2, "real": 128}, tv),
        ZooModel("googlenet", "CNN", "torchvision GoogLeNet without auxiliary heads: four-branch inception blocks, dropout",
                 googlenet, _images(image), _class_targets, class_loss, ADAMW, torch.bfloat16, {"small": 2, "real": 64}, tv),
        ZooModel("regnet", "CNN", "torchvision RegNetY-400MF: grouped bottlenecks with squeeze-excitation",
                 regnet, _images(image), _class_targets, class_loss, SGD_MOMENTUM, None, {"small": 2, "real": 128}, tv),
        ZooModel("mnasnet", "CNN", "torchvision MNASNet 1.0: inverted residuals with 5x5 depthwise convolutions",
                 mnasnet, _images(image), _class_targets, class_loss, SGD_MOMENTUM, torch.bfloat16, {"small": 2, "real": 128}, tv),
        ZooModel("mobilenet_v3_small", "CNN", "torchvision MobileNetV3-Small: hard-swish, hard-sigmoid squeeze-excitation, AdamW",
                 mobilenet_small, _images(image), _class_targets, class_loss, ADAMW, None, {"small": 2, "real": 128}, tv),
        ZooModel("resnext", "CNN", "torchvision ResNeXt-50 32x4d: grouped 3x3 convolutions in every bottleneck",
                 resnext, _images(image), _class_targets, class_loss, SGD_MOMENTUM, torch.bfloat16, {"small": 2, "real": 32}, tv),
        ZooModel("tv_vit", "vision transformer", "torchvision ViT-B/16: nn.MultiheadAttention, class token, encoder dropout",
                 tv_vit, _images(image), _class_targets, class_loss, ADAMW, torch.bfloat16, {"small": 2, "real": 32}, tv),
        ZooModel("tv_swin_v2", "vision transformer", "torchvision Swin-V2-T: cosine attention with a learned scale, continuous position bias MLP, roll",
                 tv_swin_v2, _images({"small": 32, "real": 256}), _class_targets, class_loss, ADAMW, None, {"small": 2, "real": 16}, tv),
        ZooModel("deeplabv3", "segmentation", "torchvision DeepLabV3 (ResNet-50; MobileNetV3 at the small size): dilated convolutions, ASPP, interpolation, dict output",
                 deeplabv3, _images(SEGMENT_IMAGE), _masks, segmentation_loss, SGD_MOMENTUM, None, {"small": 2, "real": 8}, tv),
        ZooModel("lraspp", "segmentation", "torchvision LR-ASPP MobileNetV3: sigmoid gating of a pooled branch, two-scale interpolation",
                 lraspp, _images(SEGMENT_IMAGE), _masks, segmentation_loss, ADAMW, torch.bfloat16, {"small": 2, "real": 16}, tv),
        ZooModel("faster_rcnn", "detection", "torchvision Faster R-CNN MobileNetV3-FPN: anchors kept in a list, proposals, RoI align, losses as a dict",
                 faster_rcnn, _detection_batch, _no_targets, detection_loss, SGD_MOMENTUM, None, {"small": 2, "real": 8}, tv,
                 unsupported="aten._local_scalar_dense"),
        ZooModel("raft", "optical flow", "torchvision RAFT-small: all-pairs correlation pyramid, grid_sample lookups, 12 recurrent (ConvGRU) refinements",
                 raft, _frame_pairs, _flows, flow_sequence_loss, ADAMW, None, {"small": 1, "real": 8}, tv),
        ZooModel("deit_distilled", "vision transformer", "timm DeiT-S distilled: class and distillation tokens, two heads trained",
                 deit_distilled, _images(image), _class_targets, distilled_loss, ADAMW, torch.bfloat16, {"small": 2, "real": 64}, tm),
        ZooModel("levit", "vision transformer", "timm LeViT-128S: BatchNorm inside attention, attention biases gathered by index, hard-swish",
                 levit, _images(image64), _class_targets, class_loss, ADAMW, None, {"small": 2, "real": 128}, tm),
        ZooModel("resmlp", "MLP", "timm ResMLP-12: affine normalisation, token-mixing linear over patches, layer scale",
                 resmlp, _images(image), _class_targets, class_loss, SGD_MOMENTUM, None, {"small": 2, "real": 64}, tm),
        ZooModel("mixer", "MLP", "timm MLP-Mixer-B/16: token- and channel-mixing MLPs (transposes), drop path",
                 mixer, _images(image), _class_targets, class_loss, ADAMW, torch.bfloat16, {"small": 2, "real": 32}, tm),
        ZooModel("poolformer", "MetaFormer", "timm PoolFormer-S12: average pooling minus identity as the token mixer, GroupNorm",
                 poolformer, _images(image), _class_targets, class_loss, ADAMW, torch.bfloat16, {"small": 2, "real": 64}, tm),
        ZooModel("nf_resnet", "CNN", "timm NF-ResNet-50: scaled weight standardisation in every forward, no normalisation layers",
                 nf_resnet, _images(image), _class_targets, class_loss, SGD_MOMENTUM, None, {"small": 2, "real": 32}, tm),
        ZooModel("mobilevit", "hybrid", "timm MobileViT-S: unfolded patches through transformer blocks, folded back, SiLU",
                 mobilevit, _images({"small": 64, "real": 256}), _class_targets, class_loss, ADAMW, None, {"small": 2, "real": 32}, tm),
        ZooModel("efficientformer", "hybrid", "timm EfficientFormer-L1: pooling mixers in 4D, attention with gathered biases in the last stage",
                 efficientformer, _images({"small": 224, "real": 224}), _class_targets, class_loss, ADAMW, torch.bfloat16, {"small": 2, "real": 64}, tm),
        ZooModel("fastvit", "hybrid", "timm FastViT-SA12: reparameterisable conv mixers (train-time branches), attention in the last stage",
                 fastvit, _images(image64), _class_targets, class_loss, SGD_MOMENTUM, None, {"small": 2, "real": 64}, tm),
        ZooModel("convit", "vision transformer", "timm ConViT-Ti: gated positional self-attention, relative positions assigned to a buffer in forward",
                 convit, _images(image), _class_targets, class_loss, ADAMW, None, {"small": 2, "real": 64}, tm),
        ZooModel("eva02", "vision transformer", "timm EVA-02-S: rotary position embedding, SwiGLU, q/v biases concatenated into one qkv bias",
                 eva02, _images(image), _class_targets, class_loss, ADAMW, torch.bfloat16, {"small": 2, "real": 64}, tm),
        ZooModel("pvt_v2", "vision transformer", "timm PVT-v2-b1: spatial-reduction attention, depthwise-conv MLP, layer norms over permuted tokens",
                 pvt_v2, _images(image64), _class_targets, class_loss, SGD_MOMENTUM, None, {"small": 2, "real": 64}, tm),
        ZooModel("video3d", "video", "a C3D-style clip classifier: Conv3d, BatchNorm3d, MaxPool3d over frames",
                 video3d, _clips, _video_targets, class_loss, ADAMW, torch.bfloat16, {"small": 2, "real": 16}),
        ZooModel("generator", "generator", "an image-to-image generator: GroupNorm, InstanceNorm, reflect padding, ConvTranspose2d, PixelShuffle",
                 generator, _images(GENERATOR_IMAGE), _generator_targets, reconstruction_loss, SGD_MOMENTUM, None, {"small": 2, "real": 16}),
        ZooModel("channels_last", "CNN", "a residual CNN in channels-last memory format (weights and inputs NHWC)",
                 channels_last_cnn, _channels_last_images(image), _class_targets, class_loss, ADAMW, torch.bfloat16, {"small": 2, "real": 64}),
    ]


#: The held-back vision models by name; none of them is in :data:`ZOO`.
HOLDOUT_VISION: dict[str, ZooModel] = {entry.name: entry for entry in _entries()}
assert not set(HOLDOUT_VISION) & set(ZOO), "a held-back model must not be in the zoo"
