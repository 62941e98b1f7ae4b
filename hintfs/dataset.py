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

A step's `.tensor` files are read together (`read_batch`) into one buffer: inside a DataLoader
worker that buffer is shared memory, so a batch reaches the training process as one storage
(one file descriptor) instead of one per tensor, copied once, from the mount. `ds.batches()`
reads ahead in threads of the training process instead of worker processes: a `.tensor` needs no
decoding, so only the reads need to overlap, and nothing crosses a process boundary.
"""
from __future__ import annotations

import collections
import errno
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hintfs.plan import read_plan_meta, read_steps, register_plan, update_step

try:   # torch is optional for the package (hintfs-client's extra `torch`); this module needs it
    import torch
    from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info
except ImportError as _err:   # pragma: no cover
    raise ImportError("hintfs.dataset needs torch: pip install 'hintfs-client[torch]' (or torch itself)") from _err


def _default_loader(path: str):
    return read_batch([path])[0]


_ALIGN = 64   # each file starts 64-byte aligned in a batch's buffer, as its tensors do in the file
_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {}


def _buffer(nbytes: int, shared: bool) -> torch.Tensor:
    """A uint8 tensor of `nbytes`, in shared memory when `shared` (made there, not copied there:
    `_new_shared` is what DataLoader's own collate uses for the same purpose)."""
    if not shared:
        return torch.empty(nbytes, dtype=torch.uint8)
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:   # pragma: no cover  (torch without it: one copy more)
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()   # type: ignore[no-any-return]
    out: torch.Tensor = torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes))
    return out


def _as_torch(buf: torch.Tensor, base: int, a: np.ndarray) -> torch.Tensor:
    """`a` (a numpy view into `buf`'s memory, which starts at address `base`) as a view of `buf`
    itself, so that the batch stays one storage."""
    dt = _TORCH_DTYPES.get(a.dtype)
    if dt is None:
        dt = _TORCH_DTYPES.setdefault(a.dtype, torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype)
    off = a.__array_interface__["data"][0] - base
    if off % a.itemsize:   # a safetensors file not written by hintfs may leave tensors unaligned
        return torch.from_numpy(a.copy())
    return buf[off:off + a.nbytes].view(dt).view(a.shape)


def _read_into(path: str, f, mv: memoryview) -> None:
    got = 0
    while got < len(mv):
        n = f.readinto(mv[got:])
        if not n:
            raise OSError(errno.EIO, f"{path}: {len(mv) - got} bytes short of its size (changed while read?)")
        got += n


def read_batch(paths: Sequence[str], *, with_meta: bool = False) -> list:
    """The `.tensor` files at `paths`, read into one buffer: a list of `{name: torch.Tensor}`, one
    per path (with `with_meta`: `(SampleMeta, {name: tensor}, file size)`).

    The tensors are views of that buffer: shared memory inside a DataLoader worker, so the batch
    reaches the training process as one storage. A raw-mode file (the storage side fell back to
    the media bytes) is transformed here, to the same tensor (`container.materialize`), and then
    held in memory of its own. Bad files raise as `load_sample` does (`TransformError`,
    `SampleEIO`); a file shorter than its size at open raises `OSError(EIO)`."""
    from hintfs.transforms.container import decode, materialize   # written alongside; imported lazily
    files = []
    try:
        for p in paths:
            files.append(open(p, "rb", buffering=0))
        sizes = [os.fstat(f.fileno()).st_size for f in files]
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size + (-size % _ALIGN))
        buf = _buffer(starts[-1], shared=get_worker_info() is not None)
        whole = buf.numpy()
        base = whole.__array_interface__["data"][0]
        mem = whole.data
        out = []
        for p, f, start, size in zip(paths, files, starts, sizes):
            view = mem[start:start + size]
            _read_into(p, f, view)
            meta, arrays = decode(view)
            if meta.mode == "tensor":
                tensors = {k: _as_torch(buf, base, a) for k, a in arrays.items()}
            else:
                tensors = {k: torch.from_numpy(a) for k, a in materialize(meta, arrays).items()}
            out.append((meta, tensors, size) if with_meta else tensors)
        return out
    finally:
        for f in files:
            f.close()


def prefetch(batches: Iterable[Sequence], *, depth: int = 3, threads: int = 1,
             load: Callable[[list], list] = read_batch) -> Iterator[list]:
    """`load(batch)` for each batch of paths, in order, with `depth` batches read ahead by
    `threads` threads of this process. `batches` is drawn here, in the caller's thread, as
    each batch is submitted (so a sampler's per-step callback runs `depth` steps ahead). Closing
    the iterator cancels what was not started and waits for what was. One thread reads the steps
    in order; 3 steps give a step whose raw samples take the client longer than a step the slack
    of the next two (bench/multimodal_loading.py's burner case: p99 37-75 ms with 2, 0.2-0.6 ms
    with 3). More threads read several steps at once, and a mount then sees its readers' step
    move ahead by reads of later steps."""
    if depth < 1 or threads < 1:
        raise ValueError(f"depth and threads must be >= 1 (got depth={depth}, threads={threads})")
    pending: collections.deque[Future] = collections.deque()
    source = iter(batches)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hintfs-prefetch") as pool:
        try:
            while True:
                while len(pending) < depth:
                    batch = next(source, None)
                    if batch is None:
                        break
                    pending.append(pool.submit(load, list(batch)))
                if not pending:
                    return
                yield pending.popleft().result()
        finally:
            for fut in pending:
                fut.cancel()


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
        return self._item(i, self.loader(self.path(i)))

    def _item(self, i: int, data):
        """Item `i` holding its loaded `data` (with `with_meta`: and its plan row)."""
        if self.with_meta:
            return {"data": data, "step": int(self.step_of[i]), "sample": self.samples[i],
                    "aug_seed": int(self.aug_seeds[i])}
        return data

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

    def __getitems__(self, indices: list[int]) -> list:
        """A batch (what DataLoader asks of a dataset that has this): with the default loader,
        the batch's files read into one buffer (`read_batch`); else item by item."""
        if self.loader is not _default_loader:
            return [self[i] for i in indices]
        loaded = read_batch([self.path(i) for i in indices])
        return [self._item(i, data) for i, data in zip(indices, loaded)]

    def batches(self, job: str | None = None, lookahead: int | None = None, *, depth: int = 3,
                threads: int = 1) -> Iterator[list]:
        """The plan's batches in step order, read `depth` steps ahead by `threads` threads of this
        process (`prefetch`): no worker processes, no tensors passed between processes. For
        `.tensor` files, which need no decoding; a custom `loader` that decodes belongs in
        `dataloader(num_workers=...)`."""
        sampler = self.batch_sampler(job, lookahead)
        return prefetch(sampler, depth=depth, threads=threads, load=self.__getitems__)

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
