"""The compiled-layer example trains under torch.compile(fullgraph=True) on the CPU."""
import importlib.util
import math
from pathlib import Path

import torch


def test_compiled_layer_example_trains():
    path = Path(__file__).resolve().parents[1] / "examples" / "compiled_layer.py"
    spec = importlib.util.spec_from_file_location("compiled_layer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch._dynamo.reset()
    losses = module.train(steps=12, gate="scalar", log=lambda *_: None)
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < losses[0]
