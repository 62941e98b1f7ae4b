"""What `hintfs VERB --help` says besides the options: a description and examples per verb.

Kept in one table so every verb (and `plan build|register|show`) has both; `build_parser` puts
them on the subparsers, and tests/unit/test_cli_errors.py checks that each --help shows one.
"""
from __future__ import annotations

# verb (or "plan build") -> (description, examples)
HELP: dict[str, tuple[str, str]] = {
    "mount": (
        "Mount a store (the [store] table of CONFIG) at MOUNTPOINT. In the background by default: "
        "this returns once the mount answers, printing the daemon's pid and log file; "
        "--foreground runs the daemon in this process (what the systemd unit does). MOUNTPOINT must be an "
        "empty folder: one that holds files is refused (a mount would hide them) unless --nonempty.",
        "  hintfs mount /etc/hintfs/srv-ckpt.toml /srv/ckpt\n"
        "  hintfs mount /etc/hintfs/srv-ckpt.toml /srv/ckpt --foreground\n"
        "  hintfs mount /etc/hintfs/srv-ckpt.toml /srv/ckpt --nonempty   # hide what /srv/ckpt holds",
    ),
    "umount": (
        "Unmount a hintfs mount cleanly: the daemon finishes pending uploads first; a daemon that "
        "is gone or does not stop in time is detached lazily. Other filesystems are never touched.",
        "  hintfs umount /srv/ckpt\n"
        "  hintfs umount /srv/ckpt --timeout 120",
    ),
    "status": (
        "Print a mount's live stats (.hintfs/stats): operation counts, latency percentiles, bytes, "
        "cache hits, errors.",
        "  hintfs status /srv/ckpt\n"
        "  hintfs status /srv/ckpt --json",
    ),
    "demo": (
        "Generate a workspace in a temporary directory, mount it, read, write, hint replicas and "
        "read .tensor samples through the mount, print a summary and unmount.",
        "  hintfs demo\n"
        "  hintfs demo --keep          # keep the workspace to look at",
    ),
    "config-doc": (
        "Print the reference of every config key (the text of docs/config.md), generated from the "
        "schema.",
        "  hintfs config-doc > docs/config.md",
    ),
    "agent": (
        "Run a storage agent (Arrow Flight) in this process, serving the [store] of CONFIG at "
        "[agent] location; it needs [agent] token_file unless [agent] auth = \"none\".",
        "  hintfs agent /etc/hintfs/node.toml\n"
        "  systemctl enable --now hintfs-agent@node     # the same, under systemd",
    ),
    "hints": (
        "Replication hints for restart storms: `set` tells the mount which files JOB will read and "
        "by how many readers, `wait` blocks until their replicas are ready, `status` prints them; "
        "`plan` reads a DCP checkpoint's .metadata and says how many replicas of which files to ask "
        "for, with the load time the scale model predicts with and without them (no mount needed).",
        "  hintfs hints set /srv/ckpt job42 --from-dcp /srv/ckpt/step_1000 --world-size 2048\n"
        "  hintfs hints set /srv/ckpt job42 --file files.json    # {\"ckpt/shard0\": 256, ...}\n"
        "  hintfs hints wait /srv/ckpt job42 --timeout 300\n"
        "  hintfs hints status /srv/ckpt job42\n"
        "  hintfs hints plan /srv/ckpt/step_1000 --world-size 2048 [--agents 128] [--costs costs.json]",
    ),
    "hints set": (
        "Tell the mount which files JOB will read and by how many readers: from a DCP checkpoint's "
        ".metadata (--from-dcp, --world-size) or from a JSON file (--file). The mount asks the agents for "
        "that many replicas before the deadline and keeps them for the TTL.",
        "  hintfs hints set /srv/ckpt job42 --from-dcp /srv/ckpt/step_1000 --world-size 2048\n"
        "  hintfs hints set /srv/ckpt job42 --file files.json --ttl 1200    # {\"ckpt/shard0\": 256, ...}",
    ),
    "hints wait": (
        "Block until every file of JOB's hint has its replicas; exit 1 (naming how many files are late) "
        "once the hint's deadline or --timeout passes.",
        "  hintfs hints wait /srv/ckpt job42 --timeout 300",
    ),
    "hints status": (
        "Print JOB's hint as the mount sees it: per file, the replicas asked for and the replicas ready.",
        "  hintfs hints status /srv/ckpt job42",
    ),
    "hints plan": (
        "Read a DCP checkpoint's .metadata and say how many replicas of which files to ask for, with the "
        "load time the scale model predicts with and without them (no mount needed).",
        "  hintfs hints plan /srv/ckpt/step_1000 --world-size 2048\n"
        "  hintfs hints plan /srv/ckpt/step_1000 --world-size 2048 --agents 128 --costs costs.json --json",
    ),
    "hints calibrate": (
        "The older spelling of `hintfs calibrate` (the two placeholders are ignored).",
        "  hintfs hints calibrate - - --agent grpc://node:8815 --path ckpt/shard0.distcp",
    ),
    "calibrate": (
        "Measure how many concurrent readers one replica serves before its p99 latency passes twice "
        "its p50: the value for [replicas] safe_readers_per_replica.",
        "  hintfs calibrate --agent grpc://node:8815 --path ckpt/shard0.distcp --token-file /etc/hintfs/token",
    ),
    "plan": (
        "Execution plans: which sample each rank reads at each step (Parquet), so agents can "
        "transform ahead.",
        "  hintfs plan build listing.txt plan.parquet --seed 0 --world-size 8 --batch-per-rank 32 --steps 1000\n"
        "  hintfs plan register /mnt/data job7 plans/plan.parquet --step 0\n"
        "  hintfs plan show plan.parquet --step 3 --rank 0",
    ),
    "plan build": (
        "Write a Parquet plan from a dataset listing (a text file of relpaths, or a directory to "
        "walk); --cost-aware balances each step's transform cost across ranks.",
        "  hintfs plan build listing.txt plan.parquet --seed 0 --world-size 8 --batch-per-rank 32 --steps 1000\n"
        "  hintfs plan build /mnt/data/videos plan.parquet --glob '*.mp4' --seed 1 --world-size 8 \\\n"
        "      --batch-per-rank 4 --steps 500 --cost-aware --catalog catalog.parquet",
    ),
    "plan register": (
        "Register a plan (a path inside the mount) and the job's current step with a mount: the "
        "agents prepare the next steps' .tensor samples.",
        "  hintfs plan register /mnt/data job7 plans/plan.parquet --step 0 --lookahead 2",
    ),
    "plan show": (
        "Print a plan's metadata (JSON), or the rows of one step: tab-separated, under a header line "
        "naming the columns (step, rank, slot, sample, aug_seed, est_cost_ms).",
        "  hintfs plan show plan.parquet\n"
        "  hintfs plan show plan.parquet --step 3 --rank 0",
    ),
    "governor": (
        "Run the GPU-memory governor of this host (the [governor] table of CONFIG) in this process.",
        "  hintfs governor /etc/hintfs/hintfs.toml\n"
        "  systemctl enable --now hintfs-governor@hintfs   # the same, under systemd",
    ),
}
