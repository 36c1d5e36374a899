"""Benchmark checkpoint saves and loads to object stores, the three side by side: our DCP
engine against torch's plain ``FsspecWriter``/``FsspecReader`` (each store's fsspec peer) and
against writing locally then uploading.

Usage::

    python benchmarks/objectstore.py --size-mb 64 --json benchmarks/results/objectstore.json [--repeats 3]
        [--stores s3,gs,az]              # default: all three, each against its local server
        [--endpoint URL --bucket NAME]   # s3 only: an S3 server of your own

The servers are moto's (``s3://``), fake-gcs-server (``gs://``) and Azurite (``az://``), each
in another process on this machine (``tests/harness/stores.py`` starts the last two): absolute
speeds say little about a real object store, so compare the ratios within one store's rows. The state is the
Lightning-shaped checkpoint of ``benchmarks/checkpoint_io.py`` (``--size-mb`` MB of fp32
parameters + two Adam moments: about 3x is written per save).

Rows (medians over interleaved repeats):
  fsspec_save    ``dcp.save`` with torch's ``FsspecWriter`` (sync_files=False), flat dict:
                 stock DCP to the bucket, no checksums, no commit marker
  local_upload   ``DCPEngine.save`` to a local folder (fsync), then ``s3fs.put`` of the files
  ours_sync      ``DCPCheckpointIO("sync").save_checkpoint`` to ``s3://``: CRC32C per item,
                 then the generation's ``COMMITTED.json`` and the cleanup of the previous one
  ours_async     ``DCPCheckpointIO("async")``: ``blocked_s`` is the host copy, ``durable_s``
                 until the marker is written
  fsspec_load    ``dcp.load`` with ``FsspecReader`` into a template
  ours_load      ``DCPCheckpointIO.load_checkpoint``: newest generation, every item's CRC32C verified
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402
from checkpoint_io import build_state, tensors_of  # noqa: E402

SAVE_METHODS = ("fsspec_save", "local_upload", "ours_sync", "ours_async")
LOAD_METHODS = ("fsspec_load", "ours_load")


def start_moto() -> tuple[Any, str]:
    """moto's S3 server in a child process on 127.0.0.1 (a free port); ``(process, endpoint)``."""
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", "from moto.server import main; import sys; main(sys.argv[1:])",
                             "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}"


def flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` as one flat dict (what stock DCP saves best)."""
    return {f"t{i}": t for i, t in enumerate(tensors_of(state))}


class Bench:
    """Runs each method; returns ``(blocked_s, durable_s)``."""

    def __init__(self, state: dict[str, Any], root: str, workdir: Path) -> None:
        from areal_lightning import DCPCheckpointIO
        from areal_lightning.objectstore import filesystem

        self.state, self.root, self.workdir = state, root, workdir
        self.flat = flat(state)
        self.fs = filesystem(root)
        self.sync = DCPCheckpointIO("sync")
        self.asynchronous = DCPCheckpointIO("async")
        self.template = {k: torch.empty_like(v) for k, v in self.flat.items()}

    def _uri(self, name: str) -> str:
        return f"{self.root}/{name}-{uuid.uuid4().hex[:8]}"

    def fsspec_save(self) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        self.last_fsspec = uri = self._uri("fsspec")
        start = time.perf_counter()
        dcp.save(self.flat, storage_writer=FsspecWriter(uri, sync_files=False, thread_count=2), no_dist=True)
        took = time.perf_counter() - start
        return took, took

    def local_upload(self) -> tuple[float, float]:
        from areal_lightning.write.dcp import DCPEngine

        local = self.workdir / f"local-{uuid.uuid4().hex[:8]}"
        engine = DCPEngine()
        start = time.perf_counter()
        engine.save(self.state, local)
        files = sorted(p for p in local.iterdir() if p.is_file())
        target = self._uri("upload").split("://", 1)[1]
        self.fs.put([str(p) for p in files], [f"{target}/{p.name}" for p in files])
        took = time.perf_counter() - start
        engine.close()
        shutil.rmtree(local)
        return took, took

    def ours_sync(self) -> tuple[float, float]:
        start = time.perf_counter()
        self.sync.save_checkpoint(self.state, f"{self.root}/ours")
        took = time.perf_counter() - start
        return took, took

    def ours_async(self) -> tuple[float, float]:
        start = time.perf_counter()
        self.asynchronous.save_checkpoint(self.state, f"{self.root}/ours_async")
        self.asynchronous.wait_for_staging()
        blocked = time.perf_counter() - start
        self.asynchronous.wait()
        return blocked, time.perf_counter() - start

    def fsspec_load(self) -> tuple[float, None]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        start = time.perf_counter()
        dcp.load(self.template, storage_reader=FsspecReader(self.last_fsspec), no_dist=True)
        return time.perf_counter() - start, None

    def ours_load(self) -> tuple[float, None]:
        start = time.perf_counter()
        self.sync.load_checkpoint(f"{self.root}/ours")
        return time.perf_counter() - start, None

    def close(self) -> None:
        self.sync.teardown()
        self.asynchronous.teardown()


def run(size_mb: int, repeats: int, root: str) -> list[dict[str, Any]]:
    workdir = Path(tempfile.mkdtemp(prefix="objectstore_bench_"))
    bench = Bench(build_state(size_mb), root, workdir)
    try:
        methods = {m: getattr(bench, m) for m in SAVE_METHODS + LOAD_METHODS}
        for fn in methods.values():  # warm-up: connections, imports, staging buffers
            fn()
        samples: dict[str, list[tuple]] = {m: [] for m in methods}
        for rep in range(repeats):
            order = list(SAVE_METHODS[rep % len(SAVE_METHODS):] + SAVE_METHODS[: rep % len(SAVE_METHODS)])
            for name in order + list(LOAD_METHODS):
                samples[name].append(methods[name]())
    finally:
        bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    nbytes = sum(t.nbytes for t in tensors_of(bench.state))
    rows = []
    for name, runs in samples.items():
        blocked = statistics.median(r[0] for r in runs)
        durable = None if runs[0][1] is None else statistics.median(r[1] for r in runs)
        rows.append({"method": name, "blocked_s": round(blocked, 4),
                     "durable_s": None if durable is None else round(durable, 4),
                     "gbps": round(nbytes / (durable if durable is not None else blocked) / 1e9, 3)})
    return rows


def report(rows: list[dict[str, Any]], nbytes: int) -> str:
    by = {r["method"]: r for r in rows}
    save_ref, load_ref = by["fsspec_save"]["durable_s"], by["fsspec_load"]["blocked_s"]
    lines = [f"state per save: {nbytes / 2**20:.0f} MiB; ratios against torch's FsspecWriter / FsspecReader",
             f"{'method':<14}{'blocked_s':>11}{'durable_s':>11}{'GB/s':>8}{'ratio':>8}"]
    for r in rows:
        dur = r["durable_s"]
        ref = load_ref if r["method"] in LOAD_METHODS else save_ref
        ratio = (dur if dur is not None else r["blocked_s"]) / ref
        lines.append(f"{r['method']:<14}{r['blocked_s']:>11.4f}{(dur if dur is not None else float('nan')):>11.4f}"
                     f"{r['gbps']:>8.3f}{ratio:>8.2f}")
    lines.append(f"ours_sync / local_upload = {by['ours_sync']['durable_s'] / by['local_upload']['durable_s']:.2f}; "
                 f"ours_async blocked / ours_sync = {by['ours_async']['blocked_s'] / by['ours_sync']['durable_s']:.3f}")
    return "\n".join(lines)


def _server(store: str, workdir: Path) -> tuple[Any, str]:
    """Start ``store``'s local server, point this process at it, make a bucket: ``(process, root URI)``."""
    import fsspec

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.harness import stores

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    if store == "s3":
        proc, endpoint = start_moto()
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        os.environ["AWS_ENDPOINT_URL"] = endpoint
    elif store == "gs":
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # the emulator has no layout API
        proc, os.environ["STORAGE_EMULATOR_HOST"] = stores.start_fake_gcs(workdir)
    else:
        proc, os.environ["AZURE_STORAGE_CONNECTION_STRING"] = stores.start_azurite(workdir)
    fsspec.filesystem({"s3": "s3", "gs": "gcs", "az": "az"}[store], skip_instance_cache=True).mkdir(bucket)
    return proc, f"{store}://{bucket}/bench"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, required=True, help="MB of fp32 parameters (about 3x is written)")
    parser.add_argument("--json", type=Path, default=None, help="where to write the results JSON")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stores", default="s3,gs,az", help="comma-separated: s3, gs, az (default: all three)")
    parser.add_argument("--endpoint", default=None, help="s3: an S3 endpoint URL (default: start moto on 127.0.0.1)")
    parser.add_argument("--bucket", default=None, help="s3: an existing bucket at --endpoint")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.stores.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in ("s3", "gs", "az")]
    if unknown or not chosen:
        parser.error(f"--stores: {unknown or chosen} not among s3, gs, az")
    nbytes = sum(t.nbytes for t in tensors_of(build_state(args.size_mb)))
    results, servers = [], {}
    for store in chosen:
        workdir = Path(tempfile.mkdtemp(prefix=f"objectstore_server_{store}_"))
        proc = None
        try:
            if store == "s3" and args.endpoint is not None:
                import boto3

                os.environ["AWS_ENDPOINT_URL"] = args.endpoint
                bucket = args.bucket or f"bench-{uuid.uuid4().hex[:8]}"
                if args.bucket is None:
                    boto3.client("s3", endpoint_url=args.endpoint).create_bucket(Bucket=bucket)
                root, servers[store] = f"s3://{bucket}/bench", args.endpoint
            else:
                proc, root = _server(store, workdir)
                servers[store] = {"s3": "moto", "gs": "fake-gcs-server", "az": "Azurite"}[store]
            rows = run(args.size_mb, args.repeats, root)
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
            shutil.rmtree(workdir, ignore_errors=True)
        print(f"\n{store}:// ({servers[store]})")
        print(report(rows, nbytes))
        results += [{"store": store, **row} for row in rows]
    if len(chosen) > 1:
        print("\nside by side: durable (load: read) seconds, and the ratio to the store's fsspec peer")
        print(f"{'method':<14}" + "".join(f"{s + '://':>20}" for s in chosen))
        for method in SAVE_METHODS + LOAD_METHODS:
            cells = []
            for store in chosen:
                by = {r["method"]: r for r in results if r["store"] == store}
                peer = by["fsspec_load" if method in LOAD_METHODS else "fsspec_save"]
                value = lambda r: r["durable_s"] if r["durable_s"] is not None else r["blocked_s"]  # noqa: E731
                cells.append(f"{value(by[method]):>11.3f} ({value(by[method]) / value(peer):4.2f}x)")
            print(f"{method:<14}" + "".join(f"{c:>20}" for c in cells))
    write_json(args.json, {"results": results, "config": {"size_mb": args.size_mb, "bytes_per_save": nbytes,
                                                          "repeats": args.repeats, "servers": servers}})


if __name__ == "__main__":
    main()
