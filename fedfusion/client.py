"""The client side of fedfusion for any Flower ClientApp: the server's initial models in, the
upload the strategies expect out. Training stays the user's own::

    from fedfusion import client

    @app.train()
    def train(msg, context):
        models = client.initial_models(msg, Net, x)   # the M models the strategy broadcast
        for model in models:
            my_training_loop(model, x, y)             # any loop, any optimiser
        return client.reply(msg, models, x, y)        # exactly the sections the server asks

:func:`make_upload` does the same without Flower (a :class:`~fedfusion.wire.ClientUpload`
for :meth:`~fedfusion.strategies.FusionStrategy.fuse_uploads`). Curvature sections
(``curvature.kron`` / ``diag`` / ``diag_full``) need laplace-torch on the client; weights and
Gram sections do not.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from flwr.app import Message, RecordDict
from torch import nn

from fedfusion.core.evaluation import LabelledData, as_labelled
from fedfusion.core.model_check import DRY_ROWS, check_received
from fedfusion.core.state import load_models
from fedfusion.curvature import DEFAULT_BACKEND, import_laplace
from fedfusion.curvature.fit import uses_laplace
from fedfusion.device import DEVICE_METRIC, device_metric, model_device
from fedfusion.flower.identity import SERVER_ID_BASE
from fedfusion.flower.train_config import (
    MODEL_KEY,
    MODEL_KWARGS_KEY,
    OPTIONAL_SECTIONS_KEY,
    SECTIONS_KEY,
)
from fedfusion.sections import (
    CURVATURE_PREFIX,
    SECTIONS,
    SectionOptions,
    SectionTable,
    build_section,
)
from fedfusion.strategies.fens import client as fens_client
from fedfusion.strategies.fens.client import is_aggregator_round
from fedfusion.strategies.requirements import ALL_REQUIREMENTS
from fedfusion.wire import WEIGHTS, ClientUpload, NumpyDict, decode_models, encode_upload

log = logging.getLogger("fedfusion")

__all__ = ["aggregator_reply", "broadcast_states", "initial_models", "is_aggregator_round",
           "make_upload", "reply", "requested_sections"]


def _content(msg: Message | RecordDict) -> RecordDict:
    return msg.content if isinstance(msg, Message) else msg


def _not_an_aggregator_round(msg: Message | RecordDict) -> None:
    """A ClientApp that answers FENS' aggregator rounds as training rounds is told how to
    tell them apart."""
    if is_aggregator_round(msg):
        raise ValueError(
            "this message is one of FENS' aggregator rounds (every round after the first), not "
            "a training round: answer it with fedfusion.client.aggregator_reply(msg, "
            "context.state, model_fn, x_held_out, y_held_out); fedfusion.client."
            "is_aggregator_round(msg) tells the two apart (docs/strategies/fens.md)")


def broadcast_states(msg: Message | RecordDict) -> list[NumpyDict]:
    """The state dicts the server broadcast (``"<m>/<param>"`` keys of the ``arrays`` record)."""
    _not_an_aggregator_round(msg)
    content = _content(msg)
    if "arrays" not in content:
        raise ValueError(f"the train message has no 'arrays' record (it holds {list(content)}): "
                         "was it sent by a fedfusion strategy's configure_train?")
    try:
        return decode_models(content["arrays"])
    except ValueError as exc:
        raise ValueError(
            f"{exc}. A fedfusion strategy broadcasts M models with keys '<m>/<param>' "
            "(fedfusion.wire.encode_models); a plain Flower ArrayRecord(model.state_dict()) "
            "is one model: pass it to strategy.start(grid, initial_arrays=...) and the strategy "
            "converts it") from exc


def initial_models(msg: Message | RecordDict, model_fn: Callable[[], nn.Module] | nn.Module,
                   x: torch.Tensor | None = None) -> list[nn.Module]:
    """One fresh ``model_fn()`` (or copy of a template module, as the strategies also take)
    per broadcast member, loaded with the server's weights (the
    throw-away init draws from a fork of torch's global RNG: the caller's does not advance),
    checked for the strategy the message names before anything trains
    (:func:`fedfusion.core.model_check.check_received`: the strategy's requirements, and with
    ``x``, a few of the client's inputs, a dry forward on them). A model the strategy cannot
    fuse raises :class:`~fedfusion.core.model_check.ModelRefused` naming the module and the
    alternative."""
    if isinstance(model_fn, nn.Module):
        model_fn = functools.partial(copy.deepcopy, model_fn)
    models = load_models(broadcast_states(msg), model_fn, "the server's member")
    content = _content(msg)
    if models and "config" in content:
        check_received(models[0], content["config"], None if x is None else x[:DRY_ROWS],
                       checks=ALL_REQUIREMENTS)
    return models


def requested_sections(msg: Message | RecordDict) -> tuple[list[str], list[str]]:
    """(required, optional) upload sections the server asks for in the train config."""
    config = _content(msg)["config"] if "config" in _content(msg) else {}
    required = list(config.get(SECTIONS_KEY, [WEIGHTS]))
    optional = [s for s in config.get(OPTIONAL_SECTIONS_KEY, []) if s not in required]
    return required, optional


def make_upload(
    models: Sequence[nn.Module],
    x: torch.Tensor | LabelledData,
    y: torch.Tensor | None = None,
    sections: Sequence[str] = (WEIGHTS,),
    *,
    optional_sections: Sequence[str] = (),
    client_id: int = 0,
    model_name: str | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    num_classes: int | None = None,
    metrics: Mapping[str, float | int] | None = None,
    started: float | None = None,
    section_table: SectionTable = SECTIONS,
    **options: Any,
) -> ClientUpload:
    """The upload of a client's trained ``models`` (its members) on its data ``(x, y)``.

    Every section is computed on the device of the models (a GPU where the caller put them
    there), the data moved to it one batch at a time; the arrays uploaded are CPU copies, the
    same layout whatever the device, and the metric ``cuda-device`` says which device it was
    (:data:`fedfusion.device.DEVICE_METRIC`).

    Parameters
    ----------
    models : sequence of nn.Module
        The client's trained members (all of one architecture, on one device).
    x, y : tensors (or NumPy arrays, lists)
        The client's training data (or ``x`` = an ``(x, y)`` pair / DataLoader, ``y`` = None),
        best left on the CPU: curvature and Gram sections are computed on it.
    sections : sequence of str, default ("weights",)
        Sections every member must carry (a failure raises).
    optional_sections : sequence of str, default ()
        Sections wanted for replays; one that fails is left out with a warning.
    client_id : int, default 0
        The client's id in the federation (the server still identifies it by its node).
    model_name, model_kwargs : optional
        The architecture as the server knows it; default: the class name of ``models[0]``
        and no kwargs.
    num_classes : int, optional
        Length of the class histogram; default: the models' output size.
    metrics : mapping, optional
        More metrics to report (e.g. a ``weighted_by_key`` for FedAvg).
    started : float, optional
        ``time.perf_counter()`` when the client began its work: the upload then reports its
        whole time as ``client-time-s``.
    section_table : mapping, default fedfusion.sections.SECTIONS
        The sections this client can compute, by name (a user's own section: a table that
        holds it, the server's strategy given the same).
    **options
        How sections are computed: ``curvature_backend`` ("" = measured default),
        ``curvature_batch_size`` (256), ``curvature_rank`` (0 = all eigenpairs),
        ``curvature_half`` (False), ``temperature`` (0.1), ``prior_var`` (0.1), ``seed`` (0),
        ``accelerate`` (None: ``FEDFUSION_ACCEL``, else off; :mod:`fedfusion.accel`);
        see :class:`fedfusion.sections.SectionOptions`.
    """
    if y is None or not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        # a pair, a DataLoader, NumPy arrays, lists: int64 labels, float32 inputs
        data = as_labelled(x if y is None else (x, y), "client data")
        x, y = data.x, data.y
    if not models:
        raise ValueError("make_upload needs at least one trained model")
    if len(y) == 0:  # no count to weight by, no curvature to fit
        raise ValueError("make_upload needs at least one training row; this client has none "
                         "(an upload's num-examples must be >= 1)")
    devices = sorted({str(model_device(model)) for model in models})
    if len(devices) > 1:
        raise ValueError(f"make_upload: the members are on different devices {devices}; "
                         "move them to one")
    try:
        section_options = SectionOptions(**options)
    except TypeError as exc:
        raise TypeError(f"{exc}; options are the fields of fedfusion.sections.SectionOptions") \
            from exc
    optional = [s for s in optional_sections if s not in sections]
    wanted = [*sections, *optional]
    backend = section_options.curvature_backend or DEFAULT_BACKEND
    if any(section.startswith(CURVATURE_PREFIX) and uses_laplace(
            models[0], section.removeprefix(CURVATURE_PREFIX), backend,
            section_options.accelerate) for section in wanted):
        # once per process, before the timed fits (else member 0's fit carries it)
        import_s = import_laplace()
        if import_s > 0:
            log.info("client %d: laplace-torch imported in %.1f s", client_id, import_s)
    section_s = dict.fromkeys(wanted, 0.0)
    failed: dict[str, str] = {}
    members: list[dict[str, NumpyDict]] = []
    for model in models:
        model.eval()
        member: dict[str, NumpyDict] = {}
        for section in wanted:
            if section in failed:
                continue
            start = time.perf_counter()
            try:
                member[section] = build_section(section, model, x, y, section_options, member,
                                                section_table)
            except Exception as exc:
                if section in sections:
                    raise
                failed[section] = f"{type(exc).__name__}: {exc}"
                log.warning("client %d: optional section %s left out: %s", client_id, section,
                            failed[section])
            section_s[section] += time.perf_counter() - start
        members.append(member)
    for member in members:  # every member carries the same sections
        for section in failed:
            member.pop(section, None)
    device = model_device(models[0])
    if num_classes is None:
        with torch.no_grad():
            num_classes = int(models[0](x[:1].to(device)).shape[-1])
    histogram = torch.bincount(y.long().cpu(), minlength=num_classes)
    return ClientUpload(
        client_id=int(client_id),
        model=model_name or type(models[0]).__name__,
        model_kwargs=dict(model_kwargs or {}),
        num_examples=len(y),
        members=members,
        metrics={
            "stats-time-s": sum(section_s.values()),
            **{f"time-s/{section}": t for section, t in section_s.items()},
            "class-histogram": [int(v) for v in histogram],
            DEVICE_METRIC: device_metric(device),
            **dict(metrics or {}),
            **({"client-time-s": time.perf_counter() - started} if started is not None else {}),
        },
    )


def reply(
    msg: Message,
    models: Sequence[nn.Module],
    x: torch.Tensor | LabelledData,
    y: torch.Tensor | None = None,
    *,
    client_id: int | None = None,
    model_name: str | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Message:
    """The Flower reply to the server's train ``msg``: :func:`make_upload` with exactly the
    sections the message asks for, encoded in fedfusion's upload format.

    ``client_id`` defaults to the node id folded into the ids an upload may claim
    (``node id % 2**30``: Flower's node ids are 64-bit; the server decides each upload's
    client id from its node anyway, :mod:`fedfusion.flower.identity`);
    ``model_name``/``model_kwargs`` default to the architecture the server broadcast (pass
    your own where clients differ, for ensembles and AMS). Other keyword arguments go to
    :func:`make_upload`. Sections are computed on the models' device (:func:`make_upload`).
    """
    _not_an_aggregator_round(msg)
    sections, optional = requested_sections(msg)
    config = msg.content["config"] if "config" in msg.content else {}
    if model_name is None and MODEL_KEY in config:
        model_name = str(config[MODEL_KEY])
        if model_kwargs is None and MODEL_KWARGS_KEY in config:
            model_kwargs = json.loads(str(config[MODEL_KWARGS_KEY]))
    upload = make_upload(
        models, x, y, sections, optional_sections=optional,
        client_id=(msg.metadata.dst_node_id % SERVER_ID_BASE if client_id is None
                   else client_id),
        model_name=model_name, model_kwargs=model_kwargs, **kwargs)
    return Message(content=encode_upload(upload), reply_to=msg)


def aggregator_reply(msg: Message, state: RecordDict, model_fn: Callable[[], nn.Module],
                     x: torch.Tensor, y: torch.Tensor, seed: int = 0,
                     device: torch.device | str | None = None) -> Message:
    """The reply to one of FENS' aggregator rounds (:func:`is_aggregator_round`): the
    server's aggregator trained on the rows ``(x, y)`` this client held out of its local
    training (``state``: the node's ``context.state``, where the models' outputs on them
    are kept between rounds), on ``device`` (default: where ``model_fn()`` builds the
    models). See :mod:`fedfusion.strategies.fens.client`."""
    return fens_client.reply(msg, state, model_fn, x, y, seed, device)
