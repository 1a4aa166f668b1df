"""Models people bring, as they are: tiny random-init transformers models built from their
configs (no download), and torchvision / timm style vision blocks defined here (the
torchvision wheel on PyPI is a CUDA build that cannot load next to the CPU torch, and timm
needs it): in-place ReLU bottlenecks, SiLU / Hardswish inverted residuals with
squeeze-excite, and a ViT whose attention unpacks shapes (fx cannot trace that).

Each entry builds (model, batches, loss_fn): ``batches(seed)`` gives two steps of
(inputs, targets), the second with another sequence length or image batch where that
applies; loss_fn None means the model computes its own loss from ``labels``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

Batch = tuple[Any, Any]
Built = tuple[nn.Module, Callable[[], list[Batch]], Callable[[Any, Any], torch.Tensor] | None]

VOCAB = 97


# ---------------------------------------------------------------------------- transformers
def _tokens(seed: int, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, shape, generator=g) for shape in shapes]


def _causal(model: nn.Module) -> Built:
    def batches() -> list[Batch]:
        return [({"input_ids": ids, "labels": ids}, None) for ids in _tokens(1, [(6, 8), (5, 6)])]

    return model, batches, None


def gpt2(layers: int = 4) -> Built:
    import transformers as T

    torch.manual_seed(0)
    config = T.GPT2Config(
        n_layer=layers,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _causal(T.GPT2LMHeadModel(config))


def llama(layers: int = 4) -> Built:
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return _causal(T.LlamaForCausalLM(config))


def bert() -> Built:
    import transformers as T

    torch.manual_seed(0)
    config = T.BertConfig(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        pad_token_id=0,
    )
    model = T.BertForSequenceClassification(config)

    def batches() -> list[Batch]:
        g = torch.Generator().manual_seed(2)
        out = []
        for ids in _tokens(2, [(6, 8), (5, 6)]):
            mask = torch.ones_like(ids)
            mask[0, -2:] = 0  # some padding: the mask must reach every layer
            labels = torch.randint(0, 3, (ids.shape[0],), generator=g)
            out.append(({"input_ids": ids, "attention_mask": mask, "labels": labels}, None))
        return out

    return model, batches, None


def _seq2seq(model: nn.Module) -> Built:
    def batches() -> list[Batch]:
        steps = []
        for ids, labels in zip(
            _tokens(3, [(6, 8), (5, 6)]), _tokens(4, [(6, 5), (5, 4)]), strict=True
        ):
            steps.append(
                ({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}, None)
            )
        return steps

    return model, batches, None


def t5() -> Built:
    import transformers as T

    torch.manual_seed(0)
    config = T.T5Config(
        num_layers=2,
        num_decoder_layers=2,
        d_model=32,
        d_ff=64,
        num_heads=2,
        d_kv=16,
        vocab_size=VOCAB,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return _seq2seq(T.T5ForConditionalGeneration(config))


def bart() -> Built:
    import transformers as T

    torch.manual_seed(0)
    config = T.BartConfig(
        encoder_layers=2,
        decoder_layers=2,
        d_model=32,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        use_cache=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    return _seq2seq(T.BartForConditionalGeneration(config))


# ---------------------------------------------------------------------------- vision
class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck: in-place ReLU, ``out += identity``."""

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet-50 layout (stem, layer1-4 of 3, 4, 6, 3 bottlenecks, pooled
    head) at 1/16 of its width."""

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), classes: int = 10) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = 8
        for i, count in enumerate(blocks):
            width = 4 * 2**i
            layer = []
            for j in range(count):
                layer.append(Bottleneck(cin, width, 2 if j == 0 and i > 0 else 1))
                cin = width * 4
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, act: type[nn.Module], gate: type[nn.Module]) -> None:
        super().__init__()
        squeezed = max(channels // 4, 4)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.act = act(inplace=True)  # type: ignore[call-arg]
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.gate = gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.gate(self.fc2(self.act(self.fc1(F.adaptive_avg_pool2d(x, 1)))))
        return x * scale


class InvertedResidual(nn.Module):
    """MobileNetV3 / EfficientNet (timm MBConv) block: expand, depthwise, squeeze-excite,
    project, with in-place activations and an in-place residual add."""

    def __init__(self, cin: int, cout: int, stride: int, act: type[nn.Module]) -> None:
        super().__init__()
        mid = cin * 4
        self.conv_pw = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.act1 = act(inplace=True)  # type: ignore[call-arg]
        self.conv_dw = nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.act2 = act(inplace=True)  # type: ignore[call-arg]
        gate = nn.Hardsigmoid if act is nn.Hardswish else nn.Sigmoid
        self.se = SqueezeExcite(mid, nn.ReLU if act is nn.Hardswish else nn.SiLU, gate)
        self.conv_pwl = nn.Conv2d(mid, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act1(self.bn1(self.conv_pw(x)))
        out = self.act2(self.bn2(self.conv_dw(out)))
        out = self.bn3(self.conv_pwl(self.se(out)))
        if self.residual:
            out += x
        return out


class MobileNet(nn.Module):
    """Stem, ``blocks`` (a Sequential of stages, each a Sequential of inverted residuals),
    head: the layout of timm's EfficientNet / torchvision's MobileNetV3."""

    def __init__(self, act: type[nn.Module], classes: int = 10) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv_stem = nn.Conv2d(3, 8, 3, 2, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.act1 = act(inplace=True)  # type: ignore[call-arg]
        stages, cin = [], 8
        for cout, stride in ((8, 1), (12, 2), (16, 2), (24, 1)):
            stages.append(
                nn.Sequential(
                    InvertedResidual(cin, cout, stride, act), InvertedResidual(cout, cout, 1, act)
                )
            )
            cin = cout
        self.blocks = nn.Sequential(*stages)
        self.conv_head = nn.Conv2d(cin, 48, 1)
        self.act2 = act(inplace=True)  # type: ignore[call-arg]
        self.classifier = nn.Linear(48, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.act1(self.bn1(self.conv_stem(x))))
        x = self.act2(self.conv_head(x))
        return self.classifier(x.mean((2, 3)))


class Attention(nn.Module):
    """timm's ViT attention (multi-head, unmasked): ``B, N, C = x.shape`` is how timm
    writes it, and what fx cannot trace (torch.export captures it)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape  # fx cannot unpack a traced shape; export can
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        return self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(B, N, C))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """timm's VisionTransformer layout: patch embedding, class token, position embedding,
    ``blocks`` (a Sequential), final norm, head on the class token."""

    def __init__(self, depth: int = 4, dim: int = 32, classes: int = 10) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch_embed = nn.Conv2d(3, dim, 4, 4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.blocks = nn.Sequential(*(ViTBlock(dim, 2) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def _images(model: nn.Module, size: int) -> Built:
    def batches() -> list[Batch]:
        g = torch.Generator().manual_seed(5)
        return [
            (torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g))
            for n in (6, 5)
        ]

    return model, batches, F.cross_entropy


def resnet() -> Built:
    return _images(ResNet(), 32)


def mobilenet() -> Built:
    return _images(MobileNet(nn.Hardswish), 16)


def efficientnet() -> Built:
    return _images(MobileNet(nn.SiLU), 16)


def vit() -> Built:
    return _images(ViT(), 16)


MODELS: dict[str, Callable[[], Built]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "t5": t5,
    "bart": bart,
    "resnet": resnet,
    "mobilenet": mobilenet,
    "efficientnet": efficientnet,
    "vit": vit,
}


_SHARED: dict[str, tuple[nn.Module, Any, Any, dict[str, torch.Tensor]]] = {}


def shared(name: str) -> Built:
    """``MODELS[name]()``, built once per process and given back with its first weights
    and buffers: a model is captured once (export takes seconds), so tests that split the
    same architecture again reuse one object rather than exporting a fresh copy."""
    if name not in _SHARED:
        model, batches, loss_fn = MODELS[name]()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        _SHARED[name] = (model, batches, loss_fn, state)
    model, batches, loss_fn, state = _SHARED[name]
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    model.train()
    return model, batches, loss_fn


def has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
