"""vLLM rollouts, the parts that need no vLLM: its one-line refusal when missing. The real engine is tested
in tests/real_vllm/ (run in .venv-vllm by scripts/test.sh, see docs/vllm.md)."""

from __future__ import annotations

import sys

import pytest
from test_memory import make_cfg

from leangrpo.trainer import Trainer
from leangrpo.vllm_engine import INSTALL, VLLMError


def test_missing_vllm_stops_in_one_line_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, whether installed or not
    cfg = make_cfg(grpo={"use_vllm": True}, output_dir=str(tmp_path / "run"))
    with pytest.raises(VLLMError) as info:
        Trainer(cfg)  # before the model (here a name that does not exist) would load
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("grpo.use_vllm needs vLLM") and INSTALL in msg
