"""What vLLM is told about a student, without vLLM (dtpshard/serve/student.py, plugin.py): the
record a student must carry, the TP size it must be served at, each refused in one line; and
importing the plugin imports no vLLM (vLLM imports it, not the other way round)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtpshard.core.errors import UserError
from dtpshard.model.checkpoint import load_hf_config
from dtpshard.model.delay import schedule
from dtpshard.model.dtp import DTPModel
from dtpshard.serve.student import check_parallel, served_student


@pytest.fixture(scope="module")
def student(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "student"
    out.mkdir()
    DTPModel.from_pretrained(tiny_dirs["qwen3"], 2, 1.5).save_pretrained(out, source=tiny_dirs["qwen3"])
    return out


def edited(student, tmp_path, **dtp):
    cfg = json.loads((student / "config.json").read_text())
    cfg["dtp"] = {k: v for k, v in {**cfg["dtp"], **dtp}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return load_hf_config(tmp_path)


def test_served_student_reads_the_record(student):
    served = served_student(load_hf_config(student))
    assert (served.settings.devices, served.settings.delay, served.settings.stage3) == (2, 1.5, "sqrt")
    assert served.schedule == schedule(served.shape.modules, 2, 1.5, "sqrt")
    assert served.family_config.model_type == "qwen3" and served.shape.qk_norm
    # δ = 1.5 over M = 6 modules: module k lands at k + 1 and k + 2; the last two never land
    assert served.schedule.last_use == {0: 2, 1: 3, 2: 4, 3: 5, 4: 5}


@pytest.mark.parametrize("drop", ["stage3", "devices", "family"])
def test_incomplete_record_refused(student, tmp_path, drop):
    with pytest.raises(UserError) as e:
        served_student(edited(student, tmp_path, **{drop: None}))
    msg = str(e.value)
    assert "\n" not in msg and drop in msg


def test_unknown_family_refused(student, tmp_path):
    with pytest.raises(UserError) as e:
        served_student(edited(student, tmp_path, family="gpt2"))
    assert "\n" not in str(e.value) and "family" in str(e.value)


def test_dense_config_refused(tiny_dirs):
    with pytest.raises(UserError, match="model_type 'dtp'"):
        served_student(load_hf_config(tiny_dirs["llama"]))


def test_other_tp_refused(student):
    served = served_student(load_hf_config(student))
    check_parallel(served, 2)
    for tp in (1, 4):
        with pytest.raises(UserError) as e:
            check_parallel(served, tp)
        assert str(e.value) == (f"this DTP student runs on L = 2 devices: serve it with --tensor-parallel-size 2 "
                                f"(not {tp})")
    with pytest.raises(UserError, match="pipeline"):
        check_parallel(served, 2, pipeline_parallel=2)


def test_plugin_imports_no_vllm():
    code = ("import sys, dtpshard.serve.plugin, dtpshard.serve.student, dtpshard.serve.env; "
            "print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
