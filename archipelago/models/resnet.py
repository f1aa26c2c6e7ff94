"""ResNet (He et al., 2015), written for one device: the image-classification family.

The shapes are the standard ones (ResNet-18/34 with basic blocks, 50/101/152 with
bottleneck blocks, the stride on the bottleneck's 3x3 convolution as torchvision does,
"ResNet v1.5"), and the parameter names are torchvision's (`conv1`, `bn1`,
`layer1.0.conv1`, ..., `fc`), so a torchvision state dict loads as it is. A small-image
stem (`small_input`: one 3x3 convolution, stride 1, no max-pool) keeps 28x28 inputs
(Fashion-MNIST) from shrinking to 1x1 before the last stage.

BatchNorm keeps running statistics; which of them islands average is the federation's
choice, not the model's. Built by `build_resnet` from a `FLAVORS` entry; `archipelago train`
trains it through the image-classification task (archipelago/tasks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .registry import build_on, register_image_family


@dataclass(frozen=True)
class ResNetArgs:
    """One ResNet shape."""

    block: Literal["basic", "bottleneck"] = "basic"
    layers: tuple[int, int, int, int] = (2, 2, 2, 2)
    num_classes: int = 1000
    in_channels: int = 3
    small_input: bool = False         # a 3x3 stride-1 stem without max-pool, for 28x28 / 32x32 images
    image_size: int = 224             # height = width of the input images (for FLOPs and input checks)
    width: int = 64                   # channels of the first stage; each later stage doubles them
    zero_init_residual: bool = False  # each block's last BatchNorm starts at 0: blocks start as identities

    @property
    def widths(self) -> tuple[int, int, int, int]:
        return (self.width, 2 * self.width, 4 * self.width, 8 * self.width)

    @property
    def expansion(self) -> int:
        return 4 if self.block == "bottleneck" else 1


FLAVORS: dict[str, ResNetArgs] = {
    "resnet18": ResNetArgs("basic", (2, 2, 2, 2)),
    "resnet34": ResNetArgs("basic", (3, 4, 6, 3)),
    "resnet50": ResNetArgs("bottleneck", (3, 4, 6, 3)),
    "resnet101": ResNetArgs("bottleneck", (3, 4, 23, 3)),
    "resnet152": ResNetArgs("bottleneck", (3, 8, 36, 3)),
    # Fashion-MNIST: one gray channel, 10 classes, 28x28 images.
    "fashion_mnist": ResNetArgs("basic", (2, 2, 2, 2), num_classes=10, in_channels=1, small_input=True,
                                image_size=28),
    # A few seconds per hundred steps on a CPU: one block per stage, a quarter of the width.
    "debug": ResNetArgs("basic", (1, 1, 1, 1), num_classes=10, in_channels=1, small_input=True,
                        image_size=28, width=16),
}

register_image_family("resnet", FLAVORS)


def _conv(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)


class BasicBlock(nn.Module):
    """3x3 -> 3x3, with the input added back (through a 1x1 projection when the shape changes)."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv(cin, width, 3, stride), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv(width, width, 3), nn.BatchNorm2d(width)
        self.downsample = _projection(cin, width, stride)

    @property
    def last_norm(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    """1x1 (narrow) -> 3x3 (strided) -> 1x1 (4x wide), with the input added back."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv(cin, width, 1), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv(width, width, 3, stride), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = _conv(width, width * 4, 1), nn.BatchNorm2d(width * 4)
        self.downsample = _projection(cin, width * 4, stride)

    @property
    def last_norm(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


def _projection(cin: int, cout: int, stride: int) -> nn.Sequential | None:
    """The shortcut's 1x1 convolution and norm where a block changes the shape, else None."""
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(_conv(cin, cout, 1, stride), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """Stem, four stages of blocks (the first block of stages 2-4 halves the resolution),
    global average pool, linear classifier. Input (batch, channels, height, width)."""

    def __init__(self, args: ResNetArgs) -> None:
        super().__init__()
        self.args = args
        block = Bottleneck if args.block == "bottleneck" else BasicBlock
        widths = args.widths
        if args.small_input:
            self.conv1 = _conv(args.in_channels, widths[0], 3)
        else:
            self.conv1 = nn.Conv2d(args.in_channels, widths[0], 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.maxpool = nn.Identity() if args.small_input else nn.MaxPool2d(3, stride=2, padding=1)
        cin, stages = widths[0], []
        for k, (width, count) in enumerate(zip(widths, args.layers)):
            blocks = []
            for j in range(count):
                blocks.append(block(cin, width, 2 if (k > 0 and j == 0) else 1))
                cin = width * args.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, args.num_classes)

    def init_weights(self, seed: int | None = None) -> None:
        """He initialisation of convolutions (fan-out), BatchNorm at identity, the
        classifier as nn.Linear's default; with zero_init_residual each block's last
        norm at 0. With `seed`, from that seed without disturbing the caller's RNG."""
        device = next(self.parameters()).device
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [],
                                   enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            self._init_params()

    def _init_params(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
                m.reset_running_stats()
        self.fc.reset_parameters()
        if self.args.zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_norm.weight)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_image(self) -> int:
        """Training FLOPs per image: 6 x the multiply-adds of convolutions and the classifier
        (forward 2, backward 4), counted by running the shapes on the meta device."""
        macs = 0

        def count(module: nn.Module, _inputs: tuple, out: torch.Tensor) -> None:
            nonlocal macs
            if isinstance(module, nn.Conv2d):
                k = module.kernel_size[0] * module.kernel_size[1] * module.in_channels // module.groups
                macs += out.numel() * k
            elif isinstance(module, nn.Linear):
                macs += out.numel() * module.in_features

        with torch.device("meta"):  # a shape-only copy: no memory, no arithmetic
            probe = ResNet(self.args)
        hooks = [m.register_forward_hook(count) for m in probe.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
        size = self.args.image_size
        probe(torch.empty(1, self.args.in_channels, size, size, device="meta"))
        for h in hooks:
            h.remove()
        return 6 * macs

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(images))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_resnet(args: ResNetArgs, device: str | torch.device = "meta") -> ResNet:
    """Construct under `device`; off meta, parameters are also initialised."""
    return build_on(device, lambda: ResNet(args))

