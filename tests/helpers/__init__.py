"""The harness the tests and the benches share (benches put the repository on sys.path and import
`tests.helpers.…`; tests never import `bench/`).

Without pytest (benches import these):
    ports          free_port(), wait_port()
    procs          REPO, HINTFS, run_hintfs(), wait_for()
    mounts         real FUSE mounts: write_config(), mount_in_process(), Mounted, force_unmount(),
                   tiny_tmpfs()
    agent_process  AgentProcess: a real `hintfs agent` on a free port (kill, restart)
    s3server       JuiceFSGateway: a real S3 server on loopback (JuiceFS's S3 gateway)
    wan            Relay, run_relay: the WAN emulator (delay and bandwidth on loopback);
                   `python -m tests.helpers.wan --help`
    staging_holder StagingHolder: holds a mount's staging files open (a bench diagnostic)
    cluster        Cluster: storage and training hosts as network namespaces on one bridge
                   (tc tbf per NIC); cleanup of a killed run's leftovers by its name prefix

For the tests only (they use pytest): s3 (the S3 fixture, skips without juicefs), security (other
users' processes), cli (the installed console script), media, tick_fs, slow_store_mount.
tests/conftest.py re-exports the names most tests import from it."""
