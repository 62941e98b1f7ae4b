"""A torch `Dataset` over an execution plan, for a normal `torch.utils.data.DataLoader`.

    ds = PlanDataset(mount, "plans/run1.parquet", rank=rank, start_step=resume_step)
    loader = ds.dataloader(num_workers=4)        # one batch per plan step, in step order
    for step, batch in zip(ds.steps, loader): ...

Item i is this rank's i-th row of the plan from `start_step` on (rows sorted by step, slot);
it loads `<mount>/<sample>.tensor` with `loader` (default: `hintfs.transforms.container.load_sample`,
imported when first needed, so the mount's `.tensor` view and its raw-bytes fallback give the
same tensor). Resume state is `(plan, step)`: only the plan's row groups from `start_step` on
are read.

With `job=...` the batch sampler registers the plan with the mount and reports each step as
its batch is requested (the mount then prepares steps N+1..N+W).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np

from hintfs.plan import read_plan_meta, read_steps, register_plan, update_step

try:   # torch is optional for the package (hintfs-client's extra `torch`); this module needs it
    from torch.utils.data import DataLoader, Dataset, Sampler
except ImportError as _err:   # pragma: no cover
    raise ImportError("hintfs.dataset needs torch: pip install 'hintfs-client[torch]' (or torch itself)") from _err


def _default_loader(path: str):
    from hintfs.transforms.container import load_sample   # written alongside; imported lazily
    return load_sample(path)


class PlanDataset(Dataset):
    """Map-style dataset of `rank`'s samples in plan order, from `start_step` (to `end_step`,
    exclusive, if given)."""

    def __init__(self, mount: str, plan_path: str, rank: int, start_step: int = 0,
                 loader: Callable[[str], object] | None = None, end_step: int | None = None,
                 suffix: str = ".tensor", with_meta: bool = False):
        self.mount = mount
        self.plan_path = plan_path if os.path.isabs(plan_path) else os.path.join(mount, plan_path)
        self.meta = read_plan_meta(self.plan_path)
        if not 0 <= rank < self.meta["world_size"]:
            raise ValueError(f"rank {rank} outside the plan's world size {self.meta['world_size']}")
        self.rank = rank
        self.start_step = start_step
        self.suffix = suffix
        self.with_meta = with_meta
        self.loader = loader or _default_loader
        table = read_steps(self.plan_path, start_step, end_step, rank=rank,
                           columns=["step", "slot", "sample", "aug_seed"])
        self.step_of = table["step"].to_numpy()
        self.samples: list[str] = table["sample"].to_pylist()
        self.aug_seeds = table["aug_seed"].to_numpy()
        # the rows of each step: [bounds[k], bounds[k+1]) for the k-th step in `steps`
        if len(self.step_of):
            change = np.flatnonzero(np.diff(self.step_of)) + 1
            self.bounds = np.concatenate([[0], change, [len(self.step_of)]])
            self.steps = self.step_of[self.bounds[:-1]].tolist()
        else:
            self.bounds = np.zeros(1, dtype=np.int64)
            self.steps = []

    def __len__(self) -> int:
        return len(self.samples)

    def path(self, i: int) -> str:
        return os.path.join(self.mount, self.samples[i] + self.suffix)

    def __getitem__(self, i: int):
        item = self.loader(self.path(i))
        if self.with_meta:
            return {"data": item, "step": int(self.step_of[i]), "sample": self.samples[i],
                    "aug_seed": int(self.aug_seeds[i])}
        return item

    def batch_sampler(self, job: str | None = None, lookahead: int | None = None,
                      plan_relpath: str | None = None) -> PlanBatchSampler:
        """One batch of indices per step, in step order. With `job`, registers the plan with the
        mount (at `start_step`) and reports each step as its batch is drawn."""
        on_step = None
        if job is not None:
            rel = plan_relpath or self.plan_path
            state = {"registered": False}

            def on_step(step: int) -> None:
                if not state["registered"]:
                    register_plan(self.mount, job, rel, step, lookahead)
                    state["registered"] = True
                else:
                    update_step(self.mount, job, step, rel)
        return PlanBatchSampler(self, on_step=on_step)

    def dataloader(self, job: str | None = None, lookahead: int | None = None, **kwargs) -> DataLoader:
        """A DataLoader yielding the plan's batches in order (`kwargs` go to DataLoader, e.g.
        num_workers, collate_fn, pin_memory; not batch_size/shuffle/sampler)."""
        return DataLoader(self, batch_sampler=self.batch_sampler(job, lookahead), **kwargs)


class PlanBatchSampler(Sampler):
    """Yields the dataset's indices step by step. `on_step(step)` runs as each batch is drawn
    (in the main process, a few batches ahead of training when workers prefetch)."""

    def __init__(self, dataset: PlanDataset, on_step: Callable[[int], None] | None = None):
        self.dataset = dataset
        self.on_step = on_step

    def __len__(self) -> int:
        return len(self.dataset.steps)

    def __iter__(self) -> Iterator[list[int]]:
        b = self.dataset.bounds
        for k, step in enumerate(self.dataset.steps):
            if self.on_step is not None:
                self.on_step(step)
            yield list(range(int(b[k]), int(b[k + 1])))
