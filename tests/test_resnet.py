"""The ResNet family: shapes and parameter counts as published, and the forward pass
against a functional reference written from the paper's description of the blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from archipelago.models.resnet import FLAVORS, ResNetArgs, build_resnet

# torchvision's published parameter counts (torchvision.models weights tables).
TORCHVISION_PARAMS = {"resnet18": 11_689_512, "resnet34": 21_797_672, "resnet50": 25_557_032,
                      "resnet101": 44_549_160, "resnet152": 60_192_808}


@pytest.mark.parametrize("flavor", sorted(TORCHVISION_PARAMS))
def test_parameter_counts_equal_torchvisions(flavor):
    model = build_resnet(FLAVORS[flavor])  # on the meta device: no memory
    assert sum(p.numel() for p in model.parameters()) == TORCHVISION_PARAMS[flavor]


def _bn(x, state, name, training):
    return F.batch_norm(x, state[f"{name}.running_mean"].clone(), state[f"{name}.running_var"].clone(),
                        state[f"{name}.weight"], state[f"{name}.bias"], training=training, eps=1e-5)


def _reference(state: dict, x: torch.Tensor, args: ResNetArgs, training: bool) -> torch.Tensor:
    """ResNet's forward from its state dict with functional ops only."""
    stem_stride, stem_pad = (1, 1) if args.small_input else (2, 3)
    x = F.relu(_bn(F.conv2d(x, state["conv1.weight"], stride=stem_stride, padding=stem_pad), state, "bn1", training))
    if not args.small_input:
        x = F.max_pool2d(x, 3, stride=2, padding=1)
    for stage, count in enumerate(args.layers, start=1):
        for j in range(count):
            name = f"layer{stage}.{j}"
            stride = 2 if (stage > 1 and j == 0) else 1
            convs = 3 if args.block == "bottleneck" else 2
            out = x
            for c in range(1, convs + 1):
                w = state[f"{name}.conv{c}.weight"]
                # The stride sits on the 3x3 convolution: the first of a basic block, the
                # second of a bottleneck.
                s = stride if (c == 1 and convs == 2) or (c == 2 and convs == 3) else 1
                out = _bn(F.conv2d(out, w, stride=s, padding=w.shape[-1] // 2), state, f"{name}.bn{c}", training)
                if c < convs:
                    out = F.relu(out)
            shortcut = x
            if f"{name}.downsample.0.weight" in state:
                shortcut = _bn(F.conv2d(x, state[f"{name}.downsample.0.weight"], stride=stride), state,
                               f"{name}.downsample.1", training)
            x = F.relu(out + shortcut)
    return F.linear(x.mean(dim=(2, 3)), state["fc.weight"], state["fc.bias"])


@pytest.mark.parametrize("flavor,size", [("resnet18", 64), ("resnet50", 64), ("fashion_mnist", 28)])
def test_forward_equals_the_functional_reference_in_train_and_eval(flavor, size):
    torch.manual_seed(0)
    args = FLAVORS[flavor]
    model = build_resnet(args, "cpu")
    with torch.no_grad():  # running statistics and norm weights away from their defaults
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    x = torch.randn(2, args.in_channels, size, size)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for training in (False, True):
        model.train(training)
        with torch.no_grad():
            got = model(x)
        torch.testing.assert_close(got, _reference(state, x, args, training), rtol=1e-4, atol=1e-5)
    assert got.shape == (2, args.num_classes)


def test_the_small_stem_keeps_28x28_images_at_4x4_in_the_last_stage():
    model = build_resnet(FLAVORS["fashion_mnist"], "cpu").eval()
    seen = {}
    model.layer4.register_forward_hook(lambda m, i, o: seen.update(shape=tuple(o.shape)))
    model(torch.randn(3, 1, 28, 28))
    assert seen["shape"] == (3, 512, 4, 4)


def test_zero_init_residual_makes_every_block_start_as_the_identity():
    for block_kind, channels in (("bottleneck", 256), ("basic", 64)):
        args = ResNetArgs(block_kind, (2, 1, 1, 1), num_classes=5, zero_init_residual=True)
        model = build_resnet(args, "cpu").eval()
        block = model.layer1[1]  # the second block: as many channels in as out, no projection
        assert block.downsample is None
        x = torch.randn(2, channels, 8, 8).relu()  # what a block sees: post-ReLU activations
        with torch.no_grad():
            torch.testing.assert_close(block(x), x, rtol=0, atol=0)
        assert build_resnet(ResNetArgs(block_kind, (2, 1, 1, 1)), "cpu").eval().layer1[1](x).ne(x).any()


def test_a_few_steps_fit_a_fixed_batch():
    torch.manual_seed(0)
    model = build_resnet(ResNetArgs("basic", (1, 1, 1, 1), num_classes=10, in_channels=1, small_input=True), "cpu")
    x, y = torch.randn(8, 1, 16, 16), torch.randint(0, 10, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
