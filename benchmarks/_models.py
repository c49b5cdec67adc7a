"""The models of the benchmark grid (``bench_peers.py``): the zoo of the earlier suites (CIFAR
VGG-11-BN and ResNet-8, the plain CNNs of the Jacobian-norm workload) and the architectures the
route choice was not tuned on, fixed before measuring."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NUM_CLASSES = 10


class StridedTanhCNN(nn.Module):
    """Strided tanh convs (3->16->32, stride 2) and a large head (2048 -> 256 -> outputs)."""

    def __init__(self, num_outputs: int = NUM_CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *(nn.Conv2d(3, 16, 5, stride=2, padding=2), nn.Tanh()),
            *(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.Tanh()),
        )
        self.head = nn.Sequential(nn.Linear(2048, 256), nn.Tanh(), nn.Linear(256, num_outputs))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).flatten(1))


class GeluCNN(nn.Module):
    """3x3 GELU convs (32/32/64/64, 2x2 average pooling twice), global mean, a linear head."""

    def __init__(self, num_outputs: int = NUM_CLASSES) -> None:
        super().__init__()
        conv = lambda a, b: (nn.Conv2d(a, b, 3, padding=1), nn.GELU())  # noqa: E731
        self.features = nn.Sequential(
            *conv(3, 32), *conv(32, 32), nn.AvgPool2d(2), *conv(32, 64), nn.AvgPool2d(2)
        )
        self.features.extend(conv(64, 64))
        self.fc = nn.Linear(64, num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.features(x).mean(dim=(2, 3)))


class DepthwiseBlock(nn.Module):
    """ConvNeXt-style: depthwise 7x7, GroupNorm, 1x1 expand x4, GELU, 1x1 project, residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.GroupNorm(4, c)
        self.pw1, self.pw2 = nn.Conv2d(c, 4 * c, 1), nn.Conv2d(4 * c, c, 1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.pw2(F.gelu(self.pw1(self.norm(self.dw(x)))))


class GroupNormDepthwise(nn.Module):
    """A 4x4 stride-4 stem (3->48), two depthwise blocks, GroupNorm, global mean, linear."""

    def __init__(self, num_outputs: int = NUM_CLASSES, width: int = 48) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 4, stride=4)
        self.blocks = nn.Sequential(DepthwiseBlock(width), DepthwiseBlock(width))
        self.norm = nn.GroupNorm(1, width)
        self.fc = nn.Linear(width, num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.norm(self.blocks(self.stem(x))).mean(dim=(2, 3)))


class DetectionHead(nn.Module):
    """A RetinaNet-style head shared by every pyramid level: class (3) and box (4) branches of
    conv3x3-ReLU-conv3x3; one output per level (both flattened), so outputs follow the pyramid."""

    def __init__(self, in_ch: int = 8, num_classes: int = 3) -> None:
        super().__init__()
        branch = lambda out: nn.Sequential(  # noqa: E731
            nn.Conv2d(in_ch, in_ch, 3, padding=1), nn.ReLU(), nn.Conv2d(in_ch, out, 3, padding=1)
        )
        self.cls, self.box = branch(num_classes), branch(4)

    def forward(self, levels: Sequence[Tensor]) -> list[Tensor]:
        return [torch.cat([self.cls(x).flatten(1), self.box(x).flatten(1)], 1) for x in levels]


class TransformerBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(*(z.transpose(1, 2) for z in (q, k, v)))
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Tokens ``(B, 16, 16)`` -> linear embedding (64) + learned positions, two pre-norm blocks
    (4 heads), LayerNorm, mean over tokens, a linear head."""

    def __init__(self, num_outputs: int = NUM_CLASSES, tokens: int = 16, d_in: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, 64)
        self.pos = nn.Parameter(0.02 * torch.randn(tokens, 64))
        self.blocks = nn.Sequential(TransformerBlock(64, 4), TransformerBlock(64, 4))
        self.norm, self.head = nn.LayerNorm(64), nn.Linear(64, num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.embed(x) + self.pos)).mean(dim=1))


# ---------------------------------------------------------------------- the earlier suites' zoo
VGG11_CFG: list[int | str] = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


class VGG(nn.Module):
    """CIFAR VGG11 with BatchNorm, every width multiplied by ``scale``."""

    def __init__(self, scale: float, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for v in VGG11_CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                c = int(int(v) * scale)
                layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()]
                c_in = c
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(c_in, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).flatten(1))


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu2 = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNet8(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.layer1 = BasicBlock(16, 16, 1)
        self.layer2 = BasicBlock(16, 32, 2)
        self.layer3 = BasicBlock(32, 64, 2)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn(self.conv(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return self.fc(out.mean(dim=(2, 3)))


def build_bn_model(name: str, seed: int = 0) -> nn.Module:
    """The named model in eval mode, its BatchNorm running statistics set by three seeded
    forward passes in train mode (so that eval-mode BatchNorm is not the identity)."""
    torch.manual_seed(seed)
    model = {"vgg11_bn_q": lambda: VGG(0.25), "resnet8": ResNet8}[name]()
    g = torch.Generator().manual_seed(seed + 100)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(1.5 * torch.randn(32, 3, 32, 32, generator=g) + 0.2)
    return model.eval()


#: the Jacobian-norm workload's plain CNNs (about 0.45M parameters each, a scalar head)
WIDTHS = {"cnn3": (64, 128, 320), "cnn8": (32, 32, 64, 64, 96, 96, 128, 128)}


class PlainCNN(nn.Module):
    """3x3 convolutions with ReLU, 2x2 max pooling every ``pool_every`` layers, a scalar head."""

    def __init__(self, widths: tuple[int, ...], pool_every: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in, size = 3, 32
        for k, c in enumerate(widths, 1):
            layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.ReLU()]
            if k % pool_every == 0:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            c_in = c
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in * size * size, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).flatten(1))


class SegHead(nn.Module):
    """A per-pixel classifier (dense outputs): conv3x3(3->16), ReLU, conv3x3(16->16), ReLU,
    conv1x1(16->classes); the dense Laplace cell (sliced vs unsliced fit)."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(
            *(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()),
            *(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()),
            nn.Conv2d(16, classes, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class CifarNet(nn.Module):
    """compare_laplace_torch's CIFAR-10 net: three 3x3 convs (``w``, ``2w``, ``2w``) each with
    ReLU and 2x2 max pooling, then ``Linear(2w*16, 128)``, ReLU, ``Linear(128, outputs)``."""

    def __init__(self, w: int = 32, num_outputs: int = NUM_CLASSES) -> None:
        super().__init__()
        conv = lambda a, b: (nn.Conv2d(a, b, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))  # noqa: E731
        self.features = nn.Sequential(*conv(3, w), *conv(w, 2 * w), *conv(2 * w, 2 * w))
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * w * 16, 128), nn.ReLU(), nn.Linear(128, num_outputs)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))
