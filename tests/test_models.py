import pytest
import torch

from fedfusion.models import available_models, build_model, count_parameters


@pytest.mark.parametrize(("name", "shape", "params"), [
    ("lenet", (1, 28, 28), 44_190),   # FedBEns / FedFisher LeNet
    ("cnn", (3, 32, 32), 939_616),    # CNN of Wang et al. 2020
])
def test_parameter_counts_match_the_papers_code(name, shape, params):
    model = build_model(name, shape, 10)
    assert count_parameters(model) == params
    assert all(p.dim() > 1 for p in model.parameters()), "FedBEns models have no bias"


@pytest.mark.parametrize("name", ["lenet", "cnn", "mlp", "convnet"])
def test_every_model_maps_images_to_logits(name):
    shape = (1, 28, 28) if name in ("lenet", "mlp") else (3, 32, 32)
    assert build_model(name, shape, 7)(torch.randn(5, *shape)).shape == (5, 7)


def test_mlp_depth_is_configurable():
    linear = [m for m in build_model("mlp", (1, 28, 28), 10, hidden_layers=4).modules()
              if isinstance(m, torch.nn.Linear)]
    assert len(linear) == 5


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="available: .*lenet"):
        build_model("resnet", (1, 28, 28), 10)
    assert {"lenet", "cnn", "mlp", "convnet"} <= set(available_models())
