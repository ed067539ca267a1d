"""A client error names the exception the ClientApp raised, also when
Flower's Ray backend wrapped it: the reasons are made by Flower's and Ray's own code here
(the actor's ``run``, ``RayTaskError.as_instanceof_cause``, the worker's reason format); the
same under a real `flwr run` is in test_e2e_flower.py."""

from __future__ import annotations

import traceback

import pytest
from flwr.app import ConfigRecord, Error, Message, RecordDict

from fedfusion.flower.client_errors import ClientError, parse_client_error
from fedfusion.strategies import FedAvg


class PartitionError(Exception):
    """A user's own exception type."""


def _flower_reason(ex: BaseException) -> str:
    """What Flower puts in ``Error.reason`` (``vce_api.worker``, ``run_clientapp``)."""
    return str(type(ex)) + ":<'" + str(ex) + "'>"


def _ray_reason(client_fn) -> str:
    """The reason of a ClientApp that runs ``client_fn`` in Flower's Ray actor: the actor
    re-raises as ClientAppException, Ray wraps that as RayTaskError(ClientAppException)."""
    ray_exceptions = pytest.importorskip("ray.exceptions")
    from flwr.simulation.ray_transport.ray_actor import VirtualClientEngineActor

    class Actor(VirtualClientEngineActor):
        pass

    try:
        Actor().run(lambda: lambda message, context: client_fn(), None, "0", None)
    except Exception as ex:  # what Ray's worker does with a task's exception
        wrapped = ray_exceptions.RayTaskError(
            "ClientAppActor.run", traceback.format_exc(), ex, proctitle="ray::ClientAppActor.run",
            pid=4242, ip="192.0.2.2", actor_repr="<ClientAppActor object>", actor_id="ab12")
        return _flower_reason(wrapped.as_instanceof_cause())
    raise AssertionError("the ClientApp did not raise")


def _fails() -> None:
    raise ValueError("unknown backend 'bogus_ggn'; available: asdl_ggn, asdl_mc")


def _fails_with_a_cause() -> None:
    try:
        {}["partition-id"]
    except KeyError as exc:
        raise RuntimeError("node config lacks partition-id\n  (set it with --node-config)") from exc


def test_a_ray_wrapped_error_names_the_clientapps_exception():
    reason = _ray_reason(_fails)
    assert "RayTaskError(ClientAppException)" in reason and "\x1b[" in reason  # Ray's form
    error = parse_client_error(reason)
    assert error.type == "ValueError"
    assert error.message == "unknown backend 'bogus_ggn'; available: asdl_ggn, asdl_mc"
    assert error.wrapper == "ray.exceptions.RayTaskError(ClientAppException)"
    assert str(error) == "ValueError: unknown backend 'bogus_ggn'; available: asdl_ggn, asdl_mc"
    assert "_fails" in error.traceback and "\x1b[" not in error.traceback


def test_a_chained_error_keeps_its_cause_and_its_whole_message():
    error = parse_client_error(_ray_reason(_fails_with_a_cause))
    assert (error.type, error.causes) == ("RuntimeError", ("KeyError: 'partition-id'",))
    assert error.message == "node config lacks partition-id\n  (set it with --node-config)"
    assert str(error).endswith("(caused by KeyError: 'partition-id')")


def test_supernode_and_in_process_reasons():
    """A SuperNode's reason carries the exception itself (its type named as Python's
    traceback names it); an in-process grid's is plain."""
    reason = _flower_reason(PartitionError("rows 5-9 missing"))
    assert str(parse_client_error(reason)) == f"{__name__}.PartitionError: rows 5-9 missing"
    assert str(parse_client_error(_flower_reason(KeyError("k")))) == "KeyError: 'k'"
    assert parse_client_error("MemoryError: client 1 ran out of memory") == ClientError(
        "MemoryError", "client 1 ran out of memory")
    assert str(parse_client_error("something odd happened")) == "something odd happened"
    # a wrapper without a traceback: the message survives, the type is not invented
    lost = parse_client_error("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'"
                              "\nException ClientAppException occurred. Message: boom'>")
    assert (lost.type, lost.message) == ("", "boom")


def test_the_exclusion_names_the_original_and_keeps_the_traceback():
    strategy = FedAvg(lambda: __import__("torch").nn.Linear(2, 2), num_clients=1)
    request = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=7,
                      message_type="train")
    reply = Message(Error(code=0, reason=_ray_reason(_fails)), reply_to=request)
    assert reply.metadata.src_node_id == 7
    with pytest.raises(RuntimeError, match="ValueError: unknown backend 'bogus_ggn'"):
        strategy.aggregate_train(1, [reply])
    [exclusion] = strategy.exclusions
    assert exclusion["reason"] == ("client error: ValueError: unknown backend 'bogus_ggn'; "
                                   "available: asdl_ggn, asdl_mc")
    assert "RayTaskError" not in exclusion["reason"]
    assert "Traceback" not in exclusion["detail"] and "_fails" in exclusion["detail"]
