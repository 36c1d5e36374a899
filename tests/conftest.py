"""Shared fixtures: tiny real transformers models (built from configs, never downloaded)."""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any

# One intra-op thread per process unless told otherwise: two xdist workers and the ranks they start
# share 2 cores, and OpenMP threads spin-waiting there cost every other process (the fast tier ran
# 11 % faster). Set before torch is imported; the test's subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # also where a plugin imported torch first

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# gcsfs asks a real GCS's storage-control gRPC API for each bucket's layout (60 s of retries
# against fake-gcs-server, which has none): the plain GCS file system, as before gcsfs 2025.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*isinstance\\(treespec, LeafSpec\\).*")

VOCAB = 16


def tiny_llama() -> Any:
    """A 2-layer Llama with a 16-token vocabulary (a few thousand parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
    )


def tiny_gpt2() -> Any:
    """A 1-layer GPT-2 with tied input/output embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    )


class LMModule(pl.LightningModule):
    """Holds a ``PreTrainedModel`` as ``self.model`` (and optionally ``self.tokenizer``)."""

    def __init__(self, model: Any, tokenizer: Any = None, lr: float = 1e-2) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class Crash(Exception):
    """Raised by :class:`CrashAt`: an in-process stand-in for a crash (a SIGKILL elsewhere)."""


class CrashAt(pl.Callback):
    """Raises :class:`Crash` at the end of the batch where ``global_step == step`` (put it before
    the checkpoint callbacks: it fires before that step's saves)."""

    def __init__(self, step: int, kill: bool = False) -> None:
        self.step, self.kill = step, kill

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            if self.kill:  # a real crash: this process is SIGKILLed
                os.kill(os.getpid(), signal.SIGKILL)
            raise Crash(f"crash at step {self.step}")


def token_loader(n_batches: int = 8, batch_size: int = 4, seq_len: int = 8, seed: int = 0) -> DataLoader:
    """A deterministic loader of random token ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n_batches * batch_size, seq_len), generator=g)
    return DataLoader(TensorDataset(ids), batch_size=batch_size, shuffle=False)


def make_trainer(callbacks: list, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU trainer."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


_DURATIONS = os.path.join(os.path.dirname(__file__), "durations.json")
_FORK_SERVERS: Any = None


def pytest_configure(config: pytest.Config) -> None:
    """Each process that runs tests starts Python through a fork server with torch, Lightning and
    transformers imported (tests/harness/forkserver.py; ``AREAL_TEST_FORK_SERVER=0``: off); not
    the xdist controller, which runs none."""
    global _FORK_SERVERS
    controller = not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))
    if controller or os.environ.get("AREAL_TEST_FORK_SERVER", "1") == "0" or _FORK_SERVERS is not None:
        return
    from tests.harness.forkserver import ForkServers

    _FORK_SERVERS = ForkServers()
    _FORK_SERVERS.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    global _FORK_SERVERS
    if _FORK_SERVERS is not None:
        _FORK_SERVERS.close()
        _FORK_SERVERS = None


@pytest.fixture(autouse=True)
def _fresh_interpreter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``fresh_interpreter`` starts every Python process as a new interpreter."""
    if request.node.get_closest_marker("fresh_interpreter") is not None:
        from tests.harness.forkserver import ENV

        monkeypatch.delenv(ENV, raising=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist (``-n 2 --dist loadgroup``): the longest tests first, so that the two workers
    end together (longest-processing-time-first). Durations are a measured run's
    (tests/durations.json, written by ``python tests/harness/durations.py JUNIT_XML``); a test not
    in it counts as a typical one of its kind. Tests of one ``xdist_group`` stay together, in
    file order. Without xdist the file order is kept."""
    if not hasattr(config, "workerinput"):
        return
    import json

    try:
        with open(_DURATIONS) as f:
            measured = json.load(f)
    except FileNotFoundError:
        measured = {}

    def seconds(item: pytest.Item) -> float:
        return measured.get(item.nodeid, 30.0 if item.get_closest_marker("slow") else 3.0)

    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        key = (mark.args[0] if mark.args else mark.kwargs.get("name")) if mark else item.nodeid
        groups.setdefault(str(key), []).append(item)
    ordered = sorted(groups.values(), key=lambda group: -sum(seconds(i) for i in group))  # stable for ties
    items[:] = [item for group in ordered for item in group]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The time xdist workers stood idle waiting for a reference another worker was producing
    (tests/harness/refcache.py logs each wait over a second)."""
    import json

    from tests.harness.refcache import WAITS

    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or hasattr(config, "workerinput"):
        return
    folder = factory.getbasetemp() / "refcache"
    if not folder.is_dir():  # no test used a shared reference
        return
    log = folder / WAITS
    waits = [json.loads(line) for line in log.read_text().splitlines() if line] if log.is_file() else []
    terminalreporter.write_sep("-", f"idle waits on shared references: {sum(w['waited'] for w in waits):.0f}s "
                                    f"over {len(waits)} waits")
    for w in sorted(waits, key=lambda w: -w["waited"])[:10]:
        terminalreporter.write_line(f"{w['waited']:7.1f}s {w['test']}")


@pytest.fixture
def tokenizer() -> Any:
    from areal_lightning.tools.demo import build_tokenizer

    return build_tokenizer()


# -- a real S3 API server (moto) on 127.0.0.1 --------------------------------------------

_S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _moto_process(log_path: Any, env: dict | None = None) -> tuple[Any, str]:
    """moto's S3 server in a child process on 127.0.0.1 (a free port): ``(process, endpoint)``,
    once it accepts connections. A process of its own, so a busy test process never slows
    its replies (an in-process server thread shares the test's GIL)."""
    import subprocess
    import sys

    from tests.harness.launch import free_port
    from tests.harness.stores import wait_for_port

    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-c", "from moto.server import main; import sys; main(sys.argv[1:])",
                             "-H", "127.0.0.1", "-p", str(port)], env={**os.environ, **(env or {})},
                            stdout=log, stderr=log)
    log.close()
    wait_for_port(proc, port, "moto's server", log_path)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Any:
    """moto's S3 server on 127.0.0.1 (a free port), with the ``AWS_*`` environment pointing at
    it for this process and the subprocesses it starts; yields the endpoint URL."""
    pytest.importorskip("s3fs")
    proc, url = _moto_process(tmp_path_factory.mktemp("moto") / "server.log")
    try:
        with _pointed_at({**_S3_ENV, "AWS_ENDPOINT_URL": url}):
            yield url
    finally:
        proc.kill()
        proc.wait()


def s3_client(endpoint: str, **credentials: str) -> Any:
    """A boto3 S3 client of the test server (default credentials: the environment's)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **credentials)


@pytest.fixture
def s3_root(s3_server: str) -> str:
    """``s3://{a fresh bucket}/root`` on the test server."""
    import uuid

    bucket = f"t-{uuid.uuid4().hex[:16]}"
    s3_client(s3_server).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/root"


def s3_objects(endpoint: str, uri: str) -> list[str]:
    """Every object key under ``uri`` (a fresh listing, no cache)."""
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    keys: list[str] = []
    for page in s3_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [obj["Key"] for obj in page.get("Contents", [])]
    return sorted(keys)


def s3_uploads(endpoint: str, uri: str) -> list[str]:
    """The keys of the incomplete multipart uploads under ``uri``."""
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    return sorted(u["Key"] for u in s3_client(endpoint).list_multipart_uploads(Bucket=bucket, Prefix=prefix)
                  .get("Uploads", []) or [])


def _pointed_at(env: dict[str, str]) -> Any:
    """Set ``env`` in this process (and so in the processes the tests start) until the end."""
    import contextlib

    @contextlib.contextmanager
    def scope() -> Any:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    return scope()


def _served(store: str, workdir: Any) -> Any:
    """Start ``store``'s server (``gs``: fake-gcs-server, ``az``: Azurite), point the environment
    at it while the session lasts, yield its :class:`~tests.harness.stores.Store`."""
    from tests.harness import stores

    start, variable = {"gs": (stores.start_fake_gcs, "STORAGE_EMULATOR_HOST"),
                       "az": (stores.start_azurite, "AZURE_STORAGE_CONNECTION_STRING")}[store]
    proc, value = start(workdir)
    try:
        with _pointed_at({variable: value}):
            yield stores.Store(store, {variable: value})
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def gs_server(tmp_path_factory) -> Any:
    """fake-gcs-server on 127.0.0.1, ``STORAGE_EMULATOR_HOST`` pointing at it; yields a ``Store``."""
    yield from _served("gs", tmp_path_factory.mktemp("fake-gcs"))


@pytest.fixture(scope="session")
def az_server(tmp_path_factory) -> Any:
    """Azurite's Blob service on 127.0.0.1, ``AZURE_STORAGE_CONNECTION_STRING`` pointing at it;
    yields a ``Store``."""
    yield from _served("az", tmp_path_factory.mktemp("azurite"))


@pytest.fixture(params=["gs", "az"])
def store(request) -> Any:
    """Each of the object stores besides S3 (``gs://``, ``az://``), its server started."""
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture(params=["s3", "gs", "az"])
def every_store(request) -> Any:
    """Each of the three object stores (``s3://``, ``gs://``, ``az://``), its server started."""
    if request.param == "s3":
        from tests.harness.stores import Store

        return Store("s3", {"AWS_ENDPOINT_URL": request.getfixturevalue("s3_server")})
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture(scope="session")
def s3_auth_server(tmp_path_factory) -> Any:
    """A second moto server that checks credentials and IAM policies (a subprocess: moto's
    auth switch is process-wide). Yields ``{"endpoint", "bucket", "admin", "no_put"}``, the last
    two being credential dicts (``aws_access_key_id``, ``aws_secret_access_key``): ``admin`` may
    do anything, ``no_put`` may list, read and delete but not write."""
    pytest.importorskip("s3fs")
    import json

    import boto3

    # the first 3 requests (the IAM calls that create the admin) need no credentials
    proc, url = _moto_process(tmp_path_factory.mktemp("moto-auth") / "server.log",
                              {"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    try:
        kw = {"endpoint_url": url, "region_name": "us-east-1"}
        iam = boto3.client("iam", aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap", **kw)
        iam.create_user(UserName="admin")
        key = iam.create_access_key(UserName="admin")["AccessKey"]
        allow_all = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="admin", PolicyName="all", PolicyDocument=json.dumps(allow_all))
        admin = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
        iam = boto3.client("iam", **admin, **kw)
        iam.create_user(UserName="no-put")
        key = iam.create_access_key(UserName="no-put")["AccessKey"]
        read_only = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Resource": "*", "Action": [
            "s3:GetObject", "s3:ListBucket", "s3:DeleteObject", "s3:ListBucketMultipartUploads"]}]}
        iam.put_user_policy(UserName="no-put", PolicyName="ro", PolicyDocument=json.dumps(read_only))
        no_put = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
        boto3.client("s3", **admin, **kw).create_bucket(Bucket="auth-bucket")
        yield {"endpoint": url, "bucket": "auth-bucket", "admin": admin, "no_put": no_put}
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def flaky_s3(s3_server: str) -> Any:
    """A :class:`~tests.harness.stores.FlakyProxy` in front of the test S3 server."""
    from tests.harness.stores import FlakyProxy

    proxy = FlakyProxy(s3_server, "s3")
    try:
        yield proxy
    finally:
        proxy.close()
