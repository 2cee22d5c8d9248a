"""Batches and step outputs cross process boundaries (Ray ranks) every step: they pickle as
numpy arrays, exactly (dtype, values, metadata), into tensors the receiver may write to."""

from __future__ import annotations

import pickle
import warnings

import torch
from geartrain.batch import Batch
from geartrain.types import StepOutput


def _batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch(
        {
            "log_probs": torch.randn(4, 3, generator=g),
            "input_ids": torch.arange(8).view(4, 2),
            "half": torch.randn(4, 2, generator=g).bfloat16(),
            "mask": torch.tensor([True, False, True, True]),
            "strided": torch.randn(3, 4, generator=g).t(),
        },
        meta={"uid": ["a", "b", "c", "d"]},
        info={"prompt_length": 1},
    )


def _roundtrip(value: object) -> object:
    """Pickle protocol 5 with out-of-band, read-only buffers, as Ray's object store hands them."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[memoryview(b).toreadonly() for b in buffers])


def test_batch_pickles_exactly_into_writable_tensors() -> None:
    batch = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on a tensor over a read-only buffer
        copy = _roundtrip(batch)
    assert isinstance(copy, Batch)
    assert copy.tensor_keys() == batch.tensor_keys() and copy.meta == batch.meta and copy.info == batch.info
    for key in batch.tensor_keys():
        assert copy[key].dtype == batch[key].dtype and torch.equal(copy[key], batch[key]), key
    copy["log_probs"][0, 0] = 123.0
    assert batch["log_probs"][0, 0] != 123.0


def test_batch_travels_out_of_band_not_through_torch_save() -> None:
    buffers: list[pickle.PickleBuffer] = []
    pickle.dumps(_batch(), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 5  # one buffer per tensor: nothing went through torch's storage pickling


def test_step_output_pickles_exactly_and_grad_tensors_keep_torch_pickling() -> None:
    out = StepOutput(outputs={"log_probs": torch.randn(2, 3), "entropy": torch.rand(2, 3)}, metrics={"tokens": 6.0})
    copy = _roundtrip(out)
    assert isinstance(copy, StepOutput) and copy.metrics == out.metrics
    assert all(torch.equal(copy.outputs[k], out.outputs[k]) for k in out.outputs)
    grad = StepOutput(outputs={"x": torch.randn(2, requires_grad=True)})
    assert pickle.loads(pickle.dumps(grad)).outputs["x"].requires_grad
