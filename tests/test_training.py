import torch

from fedfusion.models import build_model
from fedfusion.training import TrainConfig, train_local


def _train(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model("mlp", (1, 6, 6), 4, hidden_layers=1, hidden=8)
    g = torch.Generator().manual_seed(123)
    x, y = torch.randn(200, 1, 6, 6, generator=g), torch.randint(0, 4, (200,), generator=g)
    stats = train_local(model, x, y, TrainConfig(epochs=3, batch_size=32), seed)
    assert stats.samples == 600
    return model.state_dict()


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = _train(1), _train(1), _train(2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_training_fits_a_learnable_task():
    torch.manual_seed(0)
    x = torch.randn(512, 1, 4, 4)
    y = (x.flatten(1).sum(1) > 0).long()
    model = build_model("mlp", (1, 4, 4), 2, hidden_layers=1, hidden=16)
    train_local(model, x, y, TrainConfig(epochs=10, batch_size=32, lr=0.05), seed=0)
    assert (model(x).argmax(1) == y).float().mean() > 0.9
