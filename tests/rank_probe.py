"""Several train.py runs under one torchrun launch (starting torchrun and two interpreters costs more than a tiny
run), then what only the tests need to see, gathered to rank 0 and written as JSON: per run, a hash of each rank's
parameters after training (equal if DDP kept the ranks in step) and how many parameter elements each rank stores
(its FSDP shard); then each rank's error when rank 0 fails inside runtime.on_master. A hook of the tests' own:
train.py carries no diagnostics for them.

    python -m torch.distributed.run --nproc_per_node=2 tests/rank_probe.py plan.json report.json

plan.json: {"runs": [{"name": ..., "args": [train.py's arguments], "out_dir": ..., "keep": a folder to copy the out_dir
to after the run (optional)}, ...]}. The runs share one process group.
"""
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed as dist  # noqa: E402

from core import runtime  # noqa: E402
from core.errors import UserError  # noqa: E402
import train  # noqa: E402

models = []
build_model = train.build_model
train.build_model = lambda *args: models.append(build_model(*args)) or models[-1]
init_distributed = runtime.init_distributed


def join_once(device: str, backend: str = "auto") -> tuple[int, int, int, str]:
    """One process group for every run: the first run joins it, the others find it (torch 2.13 hangs in FSDP2's
    compiled collectives in a group made after another was destroyed)."""
    if dist.is_initialized():
        return dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size(), device
    return init_distributed(device, backend)


runtime.init_distributed = join_once


def probe(model) -> dict:
    """Each rank's parameter digest and parameter elements, gathered (collective)."""
    digest = hashlib.sha256()
    for p in model.parameters():  # the whole parameter, gathered from the shards under FSDP
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        digest.update(full.detach().float().cpu().numpy().tobytes())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (digest.hexdigest()[:16], local))
    return {"digests": [d for d, _ in gathered], "elements": [n for _, n in gathered],
            "total": sum(p.numel() for p in model.parameters())}


def rank_0_fails() -> list[str]:
    """What each rank raises when rank 0's work fails inside on_master (as preparing a dataset can)."""
    _, _, _, device = runtime.init_distributed("cpu")

    def work():
        raise UserError("preparing dataset 'x' failed")
    try:
        runtime.on_master(work, device)
        said = "no error"
    except UserError as e:
        said = str(e)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, said)
    return gathered


plan = json.loads(Path(sys.argv[1]).read_text())
report = {"runs": {}}
try:
    for run in plan["runs"]:
        models.clear()
        train.main(run["args"] + [f"--out_dir={run['out_dir']}"])
        report["runs"][run["name"]] = probe(models[0])
        if run.get("keep") and dist.get_rank() == 0:
            shutil.copytree(run["out_dir"], run["keep"])
    report["rank_0_fails"] = rank_0_fails()
    if dist.get_rank() == 0:
        Path(sys.argv[2]).write_text(json.dumps(report))
finally:
    runtime.destroy_distributed()
