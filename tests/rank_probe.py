"""train.py under torchrun, then what only the tests need to see, printed by rank 0: a hash of each rank's
parameters after training (equal if DDP kept the ranks in step) and how many parameter elements each rank
stores (its FSDP shard). A hook of the tests' own: train.py carries no diagnostics for them.

    python -m torch.distributed.run --nproc_per_node=2 tests/rank_probe.py --data_dir=... (train.py's arguments)
"""
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from core import runtime  # noqa: E402
import train  # noqa: E402

models = []
build_model = train.build_model
train.build_model = lambda *args: models.append(build_model(*args)) or models[-1]
try:
    train.main(sys.argv[1:])
    model = models[0]
    digest = hashlib.sha256()
    for p in model.parameters():  # the whole parameter, gathered from the shards under FSDP
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        digest.update(full.detach().float().cpu().numpy().tobytes())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (digest.hexdigest()[:16], local))
    if torch.distributed.get_rank() == 0:
        print("parameter digest per rank:", " ".join(d for d, _ in gathered))
        print("parameter elements per rank:", " ".join(str(n) for _, n in gathered),
              "of", sum(p.numel() for p in model.parameters()))
finally:
    runtime.destroy_distributed()
