"""The walk-through in docs/your_model.md (your model, your data) runs as written: prepare-data,
fine-tune with evaluation, generate, export, and transformers loads the result. Only the run is
shortened (20 steps instead of 100) to keep the suite fast."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

WALKTHROUGH = Path(__file__).resolve().parents[1] / "docs" / "your_model.md"


def _walkthrough() -> str:
    text = WALKTHROUGH.read_text()
    section = text[text.index("## Your model, your data:"):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_walkthrough_runs(tmp_path):
    script = _walkthrough()
    assert "fastpar train --init-from tiny-llama --data data --steps 100" in script
    script = (script.replace("--steps 100", "--steps 20").replace("step_100", "step_20")
              .replace("--eval-every 20", "--eval-every 10"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    rows = [json.loads(x) for x in (tmp_path / "runs/ft/metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 2 and val[-1] < val[0]               # the validation curve falls
    assert (tmp_path / "runs/ft/loss.png").stat().st_size > 1000
    assert "fastpar train: sample" in out.stdout
    assert "\ndef " in out.stdout                            # what generate printed
    assert (tmp_path / "ft-hf/tokenizer.json").read_bytes() == \
        (tmp_path / "data/tokenizer.json").read_bytes()
    assert "LlamaForCausalLM" in out.stdout
