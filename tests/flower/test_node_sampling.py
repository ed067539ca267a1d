"""Bounded waits for nodes and seeded node sampling, through the public Grid API only:
fake grids, no Flower run."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord
from torch import nn

from fedfusion.app.config import ConfigError, Settings, build_strategy
from fedfusion.core.architecture import ModelSpec
from fedfusion.flower.sampling import (
    NodeWaitTimeout,
    round_generator,
    sample_nodes,
    wait_for_nodes,
)
from fedfusion.strategies import FedAvg
from fedfusion.wire import encode_models

REPO = Path(__file__).resolve().parents[2]


class FakeGrid:
    """Only what the strategy may use of a Grid: ``get_node_ids()``. Node ids connect
    ``per_poll`` at a time (all at once when 0), listed in a shuffled order."""

    def __init__(self, node_ids: list[int], per_poll: int = 0, seed: int = 0):
        self.node_ids, self.per_poll, self.polls = list(node_ids), per_poll, 0
        self._order = random.Random(seed)

    def get_node_ids(self) -> list[int]:
        self.polls += 1
        connected = self.node_ids[: self.per_poll * self.polls] if self.per_poll else list(
            self.node_ids)
        self._order.shuffle(connected)
        return connected

    def __getattr__(self, name: str):  # any other Grid method is a test failure
        raise AssertionError(f"the strategy used grid.{name}; only get_node_ids is public")


class FakeClock:
    """``clock`` and ``sleep`` for :func:`wait_for_nodes`: time passes only when slept."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _model() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 3))


def _arrays(strategy: FedAvg):
    return encode_models(strategy.initial_models())


def test_waits_until_enough_nodes_connect():
    grid, clock = FakeGrid([11, 12, 13, 14], per_poll=1), FakeClock()
    nodes = wait_for_nodes(grid, 3, timeout=60, clock=clock, sleep=clock.sleep)
    assert nodes == [11, 12, 13] and grid.polls == 3 and clock.now == 2.0


def test_times_out_naming_how_many_connected_of_how_many_required():
    grid, clock = FakeGrid([1, 2, 3, 4]), FakeClock()
    with pytest.raises(NodeWaitTimeout, match=re.escape(
            "round 1: 4 node(s) connected of the 6 required within 30 s")) as info:
        wait_for_nodes(grid, 6, timeout=30, clock=clock, sleep=clock.sleep, where="round 1")
    assert (info.value.connected, info.value.required, info.value.timeout) == (4, 6, 30)
    assert isinstance(info.value, TimeoutError)
    assert clock.now == pytest.approx(30.0)  # gave up at the timeout, not one poll later
    assert grid.polls == 31


def test_the_strategy_fails_a_round_with_too_few_nodes_after_its_timeout():
    """num_clients above the connected nodes: a NodeWaitTimeout after node_wait_timeout
    seconds (real time here, 0.3 s), not Flower's endless "Waiting for nodes to connect"."""
    strategy = FedAvg(_model(), num_clients=6, node_wait_timeout=0.3)
    with pytest.raises(NodeWaitTimeout, match=re.escape(
            "[fedavg] round 1: 4 node(s) connected of the 6 required within 0.3 s")):
        strategy.configure_train(1, _arrays(strategy), ConfigRecord(), FakeGrid([1, 2, 3, 4]))


def test_the_strategy_samples_with_its_own_seeded_generator():
    """fraction_train samples the same nodes for the same seed and round whatever order the
    grid lists them in, other nodes for another seed or round, and leaves the global RNGs
    (random, numpy, torch) untouched."""
    node_ids, template = list(range(100, 120)), _model()  # (building a model draws)

    def sampled(seed: int, server_round: int = 1, order: int = 0) -> list[int]:
        strategy = FedAvg(template, min_available_nodes=20, min_train_nodes=2,
                          fraction_train=0.25, seed=seed)
        messages = strategy.configure_train(server_round, _arrays(strategy), ConfigRecord(),
                                            FakeGrid(node_ids, seed=order))
        return [m.metadata.dst_node_id for m in messages]

    states = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    first = sampled(seed=3)
    assert len(first) == 5 and first == sorted(set(first)) and set(first) <= set(node_ids)
    assert sampled(seed=3, order=7) == first
    assert sampled(seed=4) != first and sampled(seed=3, server_round=2) != first
    assert random.getstate() == states[0]
    assert np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])


def test_all_nodes_are_sent_to_by_default():
    strategy = FedAvg(_model(), num_clients=3)
    messages = strategy.configure_train(1, _arrays(strategy), ConfigRecord(),
                                        FakeGrid([30, 10, 20, 40]))
    assert [m.metadata.dst_node_id for m in messages] == [10, 20, 30, 40]


def test_sample_nodes_refuses_impossible_sizes():
    with pytest.raises(ValueError, match="cannot sample 3 of 2"):
        sample_nodes([1, 2], 3, round_generator(0, 1))


def test_node_wait_timeout_is_a_run_config_key_and_a_constructor_argument():
    spec = ModelSpec("mlp", (1, 28, 28), 10)
    strategy = build_strategy(Settings(node_wait_timeout=12.5), spec)
    assert strategy.node_wait_timeout == 12.5
    assert FedAvg(_model()).node_wait_timeout == Settings().node_wait_timeout == 600.0
    assert Settings.from_mapping({"node-wait-timeout": 7}).node_wait_timeout == 7.0
    with pytest.raises(ConfigError, match="node-wait-timeout"):
        Settings(node_wait_timeout=0).validate()
    with pytest.raises(ValueError, match="node_wait_timeout must be > 0 seconds"):
        FedAvg(_model(), node_wait_timeout=-1)
    assert FedAvg(_model(), node_wait_timeout=float("inf")).node_wait_timeout == float("inf")


def test_no_strategy_imports_flowers_private_sampling_helper():
    private = re.compile(r"^\s*(from|import)\s+flwr\S*strategy_utils", re.MULTILINE)
    assert not [p for p in (REPO / "fedfusion").rglob("*.py") if private.search(p.read_text())]
