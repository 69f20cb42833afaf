"""ResNet (He et al. 2016) as torchvision writes it: the same modules, parameter names and
initialisation, so a torchvision state dict loads into it.

ResNet-50 is v1.5 (as torchvision, NVIDIA's DeepLearningExamples and DLPerf): a
bottleneck that downsamples does so with the stride on its 3x3 conv, not the first 1x1.
Two stems: ImageNet's (7x7 stride-2 conv, then 3x3 stride-2 max-pool: 224 -> 56) and one
for small images (a 3x3 stride-1 conv, no pool: for 8x8 digits or 32x32 CIFAR).

Written with ``sbpflow.nn`` only: the same code runs locally, data parallel on global tensors
(parameters B, batch S(0); BatchNorm computes the statistics of the whole global batch, or
of each rank's part with ``sync_stats=False`` as torch DDP does), and, as the torch twin
(``spec.build_torch()``), as a plain ``torch.nn.Module``.

Shapes: N batch, C channels, H x W image.
"""

from __future__ import annotations

from dataclasses import dataclass

import sbpflow.nn as nn
from sbpflow.models._twin import twin_builder
from sbpflow.models.spec import ModelSpec, register


@dataclass
class ResNetConfig:
    block: str = "bottleneck"  # "basic" (ResNet-18/34) or "bottleneck" (ResNet-50/101/152)
    layers: tuple = (3, 4, 6, 3)  # blocks in each of the four stages
    num_classes: int = 1000  # outputs of the final Linear
    in_channels: int = 3  # image channels (3 RGB, 1 grey)
    width: int = 64  # channels of the stem and stage 1, doubled per stage (torchvision: 64)
    small_input: bool = False  # small-image stem: 3x3 stride-1 conv and no max-pool
    zero_init_residual: bool = False  # start each block's last BN weight at 0 (torchvision)

    def __post_init__(self):
        """Raises ValueError for an unknown block kind or not four stages."""
        if self.block not in ("basic", "bottleneck"):
            raise ValueError(f"ResNet: block must be 'basic' or 'bottleneck', got "
                             f"{self.block!r}")
        if len(self.layers) != 4:
            raise ValueError(f"ResNet: layers gives the blocks of 4 stages, got "
                             f"{self.layers}")


def conv3x3(in_planes: int, out_planes: int, stride: int = 1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convs and a shortcut (ResNet-18/34). Output channels: planes."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample=None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample  # matches the shortcut's shape when stride/width change
        self.stride = stride

    def forward(self, x):  # (N, inplanes, H, W)
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))  # (N, planes, H/stride, W/stride)
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)  # (N, planes, H/stride, W/stride)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride: v1.5), 1x1 expand, and a shortcut
    (ResNet-50/101/152). Output channels: planes * 4."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample=None):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):  # (N, inplanes, H, W)
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))  # (N, planes, H, W)
        out = self.relu(self.bn2(self.conv2(out)))  # (N, planes, H/stride, W/stride)
        out = self.bn3(self.conv3(out))  # (N, 4 planes, H/stride, W/stride)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """The classifier: ``model(images) -> logits``; images (N, in_channels, H, W) float,
    logits (N, num_classes). ImageNet stem: H = W = 224 gives 7x7 maps before pooling;
    any size >= 32 works. Small stem: any size >= 8 works."""

    def __init__(self, config: ResNetConfig):
        super().__init__()
        block = BasicBlock if config.block == "basic" else Bottleneck
        w = config.width
        self.inplanes = w
        if config.small_input:
            self.conv1 = nn.Conv2d(config.in_channels, w, kernel_size=3, stride=1, padding=1,
                                   bias=False)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(config.in_channels, w, kernel_size=7, stride=2, padding=3,
                                   bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(block, w, config.layers[0])
        self.layer2 = self._make_layer(block, 2 * w, config.layers[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * w, config.layers[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * w, config.layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * w * block.expansion, config.num_classes)

        # torchvision's initialisation (the Linear keeps its default).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        if config.zero_init_residual:  # each block starts as the identity (Goyal et al. 2017)
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.constant_(m.bn3.weight, 0)
                elif isinstance(m, BasicBlock):
                    nn.init.constant_(m.bn2.weight, 0)

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1):
        """A stage: ``blocks`` blocks, the first one changing stride and width."""
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):  # (N, C, H, W)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))  # (N, w, H/4, W/4); small: H, W
        x = self.layer1(x)  # (N, w * e, ., .)  e = block.expansion
        x = self.layer2(x)  # (N, 2w * e, ./2, ./2)
        x = self.layer3(x)  # (N, 4w * e, ./4, ./4)
        x = self.layer4(x)  # (N, 8w * e, ./8, ./8)
        x = self.avgpool(x).flatten(1)  # (N, 8w * e)
        return self.fc(x)  # (N, num_classes)


def _spec(name: str, config: ResNetConfig) -> ModelSpec:
    # Data parallel only ("dp", {}): convolutions' activations dwarf their weights.
    return register(ModelSpec(name=name, family="resnet", task="image", config=config,
                              builder=ResNet, default_layout="dp",
                              torch_builder=twin_builder(__name__, "ResNet")))


_spec("resnet18", ResNetConfig(block="basic", layers=(2, 2, 2, 2)))  # 11.7M parameters
_spec("resnet50", ResNetConfig(block="bottleneck", layers=(3, 4, 6, 3)))  # 25.6M, v1.5
# scikit-learn's 8x8 grey digits, 10 classes: the small stem (8 -> 8, 4, 2, 1 per stage).
_spec("resnet18-digits", ResNetConfig(block="basic", layers=(2, 2, 2, 2), num_classes=10,
                                      in_channels=1, small_input=True))  # 11.2M
# The same at a quarter of the width (0.7M parameters): fast enough for tests and CPU demos.
_spec("resnet18-digits-mini", ResNetConfig(block="basic", layers=(2, 2, 2, 2), num_classes=10,
                                           in_channels=1, width=16, small_input=True))
