"""Static checks of the container deployment: docker-compose.yml, Dockerfile, .env.example.

No Docker engine is needed: the files are parsed and cross-checked against each other,
against pyproject.toml and against `service.config.Settings`.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from service.cli import _is_loopback
from service.config import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
ENV_EXAMPLE = ROOT / ".env.example"

SERVICES = ("postgres", "ray-head", "ray-worker", "api")
RAY_USERS = ("ray-head", "ray-worker", "api")  # join the cluster or submit jobs to it
# ${VAR}, ${VAR:-default}, ${VAR:?message}, ...
REF = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<mod>:?[-?+][^}]*)?\}")
SECRETISH = re.compile(r"PASSWORD|TOKEN|SECRET", re.IGNORECASE)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


def env_of(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment as a mapping (compose allows a mapping or KEY=VALUE list)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def argv_of(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command") or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def flag(argv: list[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` in argv, else None."""
    for i, arg in enumerate(argv):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def interpolated(value: str, fill: str = "x") -> str:
    """`value` with every ${...} reference replaced, as compose would (with a dummy value)."""
    return REF.sub(fill, value)


def is_reference(value: str) -> bool:
    return REF.fullmatch(value) is not None


def with_defaults(value: str) -> str:
    """`value` as compose reads it with none of the variables set: `${X:-d}` gives d."""
    return REF.sub(lambda m: (m["mod"] or "")[2:] if (m["mod"] or "")[:2] == ":-" else "", value)


def published(service: dict[str, Any]) -> list[tuple[str | None, int, int]]:
    """(host ip, host port, container port) of each short-syntax or long-syntax port, with
    `${VAR:-default}` host ports read as their defaults."""
    out: list[tuple[str | None, int, int]] = []
    for p in service.get("ports", []):
        if isinstance(p, dict):
            out.append((p.get("host_ip"), int(p["published"]), int(p["target"])))
            continue
        parts = with_defaults(str(p)).split(":")
        ip = parts[0] if len(parts) == 3 else None
        out.append((ip, int(parts[-2]), int(parts[-1].split("/")[0])))
    return out


def torch_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d for d in deps if re.match(r"torch\s*==", d)]
    assert len(pins) == 1, deps
    return pins[0].split("==", 1)[1].strip()


def test_the_four_services_exist(services: dict[str, dict[str, Any]]) -> None:
    assert set(SERVICES) <= set(services)
    for name in ("ray-head", "ray-worker", "api"):
        assert services[name].get("build") or services[name].get("image"), name
    assert str(services["postgres"]["image"]).startswith("postgres:16")
    assert "pg_isready" in str(services["postgres"]["healthcheck"]["test"])


def test_volumes(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    assert {"pgdata", "checkpoints"} <= set(compose["volumes"])
    assert any(str(v).startswith("pgdata:") for v in services["postgres"]["volumes"])
    for name in RAY_USERS:
        ckpt = env_of(services[name])["QKSCOPE_CHECKPOINT_DIR"]
        assert f"checkpoints:{ckpt}" in services[name]["volumes"], name


def test_api_reaches_the_ray_dashboard(services: dict[str, dict[str, Any]]) -> None:
    url = urlsplit(env_of(services["api"])["QKSCOPE_RAY_ADDRESS"])
    head = argv_of(services["ray-head"])
    assert url.scheme == "http"
    assert url.hostname == "ray-head"
    assert str(url.port) == flag(head, "--dashboard-port")
    assert flag(head, "--dashboard-host") == "0.0.0.0"  # reachable from the api container
    assert "ray-head" in services["api"]["depends_on"]


def test_database_urls_point_at_postgres(services: dict[str, dict[str, Any]]) -> None:
    pg = env_of(services["postgres"])
    for name in ("api", "ray-head"):
        raw = env_of(services[name])["QKSCOPE_DATABASE_URL"]
        url = urlsplit(interpolated(raw))
        assert url.scheme.startswith("postgresql"), name
        assert url.hostname == "postgres", name
        assert url.port == 5432, name
        assert url.path.lstrip("/") == pg["POSTGRES_DB"], name
        assert url.username == pg["POSTGRES_USER"], name
        # the password part is the same reference postgres gets, never a literal
        password = raw.split("://", 1)[1].rsplit("@", 1)[0].split(":", 1)[1]
        assert is_reference(password), name
        ref, pg_ref = REF.fullmatch(password), REF.fullmatch(pg["POSTGRES_PASSWORD"])
        assert ref and pg_ref and ref["name"] == pg_ref["name"], name
    assert services["api"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_runner_jobs_get_the_database_url_from_the_head_node(
    services: dict[str, dict[str, Any]],
) -> None:
    """Not through the job's runtime_env (Ray's jobs API would show the password)."""
    assert env_of(services["api"]).get("QKSCOPE_RUNNER_DB_SOURCE") == "node"
    assert "QKSCOPE_DATABASE_URL" in env_of(services["ray-head"])
    assert "QKSCOPE_DATABASE_URL" not in env_of(services["ray-worker"])  # workers need none


def test_ray_token_auth_everywhere(services: dict[str, dict[str, Any]]) -> None:
    tokens = set()
    for name, svc in services.items():
        argv = argv_of(svc)
        if name in RAY_USERS or argv[:1] == ["ray"]:
            env = env_of(svc)
            assert env.get("RAY_AUTH_MODE") == "token", name
            assert is_reference(env.get("RAY_AUTH_TOKEN", "")), name
            tokens.add(env["RAY_AUTH_TOKEN"])
    assert len(tokens) == 1, tokens


def test_worker_joins_the_head(services: dict[str, dict[str, Any]]) -> None:
    head, worker = argv_of(services["ray-head"]), argv_of(services["ray-worker"])
    assert head[:2] == ["ray", "start"] and "--head" in head and "--block" in head
    assert worker[:2] == ["ray", "start"] and "--block" in worker
    port = flag(head, "--port")
    assert port is not None and port != "6379"  # 6379 is Redis's port
    assert flag(worker, "--address") == f"ray-head:{port}"
    assert flag(head, "--num-cpus") is not None
    assert "ray-head" in services["ray-worker"]["depends_on"]


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = (service.get("deploy") or {}).get("resources", {}).get("reservations", {})
    return [d for d in reservations.get("devices", []) if "gpu" in d.get("capabilities", [])]


def build_target(service: dict[str, Any]) -> str | None:
    build = service.get("build")
    return build.get("target") if isinstance(build, dict) else None


def test_gpu_workers_get_one_gpu_set_each_and_cuda_torch(
    services: dict[str, dict[str, Any]],
) -> None:
    """Every GPU service names its own device ids (no `count: all` that every replica of
    a scaled service would share), runs one replica, tells Ray exactly that many GPUs, and
    is built from the Dockerfile's gpu target (CUDA torch)."""
    gpu_services = {name: svc for name, svc in services.items() if gpu_devices(svc)}
    assert "ray-worker" in gpu_services
    seen: set[str] = set()
    for name, svc in gpu_services.items():
        ids: list[str] = []
        for d in gpu_devices(svc):
            assert d.get("driver") == "nvidia", name
            assert "count" not in d, f"{name}: use device_ids, not count"
            assert d.get("device_ids"), name
            ids += [str(i) for i in d["device_ids"]]
        assert not seen & set(ids), f"{name}: GPUs {seen & set(ids)} given to two services"
        seen |= set(ids)
        assert (svc.get("deploy") or {}).get("replicas", 1) == 1, name
        assert flag(argv_of(svc), "--num-gpus") == str(len(ids)), name
        assert build_target(svc) == "gpu", name
    for name, svc in services.items():
        if name not in gpu_services and (svc.get("build") or argv_of(svc)[:1] == ["ray"]):
            assert build_target(svc) == "cpu", name  # no CUDA torch where no GPU is
            assert flag(argv_of(svc), "--num-gpus") in (None, "0"), name


def dockerfile_stages() -> dict[str, str]:
    """Each build stage's text by its name (`FROM ... AS name`)."""
    code = "\n".join(
        ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")
    )
    parts = re.split(r"^FROM\s+", code, flags=re.MULTILINE)[1:]
    stages = {}
    for part in parts:
        m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", part)
        assert m, part
        stages[m.group(2) or m.group(1)] = part
    return stages


def test_dockerfile_cpu_and_gpu_targets_carry_the_right_torch() -> None:
    stages = dockerfile_stages()
    assert {"cpu", "gpu"} <= set(stages)
    pin = torch_pin()
    for target, index in (("cpu", "/whl/cpu"), ("gpu", "/whl/cu")):
        text = stages[target]
        args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.MULTILINE))
        urls = [v for k, v in args.items() if k.endswith("INDEX_URL")]
        assert len(urls) == 1 and index in urls[0], (target, urls)
        assert re.search(r'pip install --index-url "\$\{\w*INDEX_URL\}" "torch==', text), target
        # The project from its wheel, not editable, after torch.
        assert re.search(r"^RUN pip install /wheels/qkscope-\*\.whl", text, re.MULTILINE), target
        assert not re.search(r"pip install[^\n]*\s-e\s", text), target
        assert text.index("torch==") < text.index("/wheels/qkscope")
    head_args = dict(re.findall(r"^ARG (\w+)=(\S+)", DOCKERFILE.read_text(), re.MULTILINE))
    assert head_args["TORCH_VERSION"] == pin


def test_published_ports(services: dict[str, dict[str, Any]]) -> None:
    ports = {name: published(svc) for name, svc in services.items()}
    assert any(host == 8000 and target == 8000 for _, host, target in ports["api"])
    dashboard = [(ip, host) for ip, host, target in ports["ray-head"] if target == 8265]
    assert dashboard == [("127.0.0.1", 8265)]  # the dashboard never listens publicly
    assert not ports.get("postgres")


def test_no_literal_secrets(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        for key, value in env_of(svc).items():
            if SECRETISH.search(key):
                assert is_reference(value), f"{name}: {key} must be a ${{...}} reference"
            url = urlsplit(interpolated(value, fill="REF"))
            if url.scheme and url.password is not None:
                assert url.password == "REF", f"{name}: {key} embeds a literal password"


def test_required_secrets_fail_fast_and_are_in_env_example(
    services: dict[str, dict[str, Any]],
) -> None:
    example = dict(
        line.split("=", 1)
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    required = set()
    for svc in services.values():
        for key, value in env_of(svc).items():
            if SECRETISH.search(key):
                m = REF.fullmatch(value)
                assert m and (m["mod"] or "").startswith(":?"), f"{key} must use ${{VAR:?...}}"
                required.add(m["name"])
    assert required == {"POSTGRES_PASSWORD", "RAY_AUTH_TOKEN", "QKSCOPE_API_TOKENS"}
    assert required <= set(example)
    for name in required:
        assert re.search(r"change|replace|generate", example[name]), f"{name}: not a placeholder"


def test_qkscope_env_names_are_settings(services: dict[str, dict[str, Any]]) -> None:
    fields = set(Settings.model_fields)
    for name, svc in services.items():
        for key in env_of(svc):
            if key.startswith("QKSCOPE_"):
                assert key.removeprefix("QKSCOPE_").lower() in fields, f"{name}: {key}"


def test_api_serves_publicly_only_with_tokens(services: dict[str, dict[str, Any]]) -> None:
    argv = argv_of(services["api"])
    assert argv[:2] == ["qkscope", "serve"]
    host = flag(argv, "--host")
    assert host is not None
    port = flag(argv, "--port") or "8000"
    assert any(target == int(port) for _, _, target in published(services["api"]))
    env = env_of(services["api"])
    if not _is_loopback(host):  # `qkscope serve` refuses this without tokens
        assert is_reference(env.get("QKSCOPE_API_TOKENS", ""))
    assert env.get("QKSCOPE_RAY_ADDRESS")  # no embedded Ray head inside the api container


def test_dockerfile_builds_the_project_wheel_with_its_migrations() -> None:
    text = DOCKERFILE.read_text()
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    base = dict(re.findall(r"^ARG (\w+)=(\S+)", code, re.MULTILINE))["BASE_IMAGE"]
    assert base == "python:3.11-slim"
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS base\b", code, re.MULTILINE)
    wheel = dockerfile_stages()["wheel"]
    assert re.search(r"pip wheel --no-deps --wheel-dir /wheels \.(?:\s|$)", wheel)
    # Every package setup.py ships (the first real build lacked qkscope/, the client package
    # the CLI imports: the API container could not start).
    setup_packages = re.findall(r'"(\w+)\*"', (ROOT / "setup.py").read_text())
    assert {"service", "workers", "qkscope"} <= set(setup_packages)
    sources = [f"{p}/" for p in setup_packages] + ["migrations/"]
    for src in (*sources, "pyproject.toml", "setup.py", "README.md"):
        assert re.search(rf"^COPY\b[^\n]*\b{re.escape(src)}", wheel, re.MULTILINE), src
    assert re.search(r"^COPY\b[^\n]*\bstudy_defs/", code, re.MULTILINE)
    # setup.py ships migrations/ in the wheel (tests/test_packaging.py builds and checks it).
    setup = (ROOT / "setup.py").read_text()
    assert '"qkscope_migrations": "migrations"' in setup
    literal = re.findall(r"torch\s*[=<>~!]=?\s*([0-9][\w.+]*)", code)
    assert all(v == torch_pin() for v in literal), literal
    assert not re.search(r"(PASSWORD|TOKEN|SECRET)\w*\s*=", code), "no secrets in the image"


# --- build arguments: what a user gets by default is unchanged (issue 21) -------------------


def build_args(service: dict[str, Any]) -> dict[str, str]:
    build = service.get("build")
    assert isinstance(build, dict)
    return {k: with_defaults(str(v)) for k, v in (build.get("args") or {}).items()}


def dockerfile_arg_defaults() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)", DOCKERFILE.read_text(), re.MULTILINE))


def test_build_arg_defaults_are_python_slim_pytorch_index_and_no_extra_ca(
    services: dict[str, dict[str, Any]],
) -> None:
    """Unset, the build arguments give python:3.11-slim, torch from PyTorch's CPU/CUDA
    index and no extra CA, in the Dockerfile and in compose alike."""
    arg = dockerfile_arg_defaults()
    assert arg["BASE_IMAGE"] == "python:3.11-slim"
    assert arg["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert arg["CUDA_TORCH_INDEX_URL"].startswith("https://download.pytorch.org/whl/cu")
    for name in ("TORCH_WHEELS", "EXTRA_CA_CERTS"):  # folders that hold nothing by default
        folder = ROOT / arg[name]
        assert folder.is_dir(), name
        assert not [p for p in folder.iterdir() if p.suffix in (".whl", ".crt", ".pem")], name
    for name in ("ray-head", "api", "ray-worker"):
        args = build_args(services[name])
        assert args["BASE_IMAGE"] == arg["BASE_IMAGE"], name
        assert args["EXTRA_CA_CERTS"] == arg["EXTRA_CA_CERTS"], name
        for key, value in args.items():
            assert key in arg, f"{name}: build arg {key} is not an ARG of the Dockerfile"
            assert value == arg[key], f"{name}: {key} default {value} != Dockerfile {arg[key]}"
    assert build_target(services["api"]) == "cpu"
    assert build_args(services["api"])["TORCH_INDEX_URL"] == arg["TORCH_INDEX_URL"]


def test_torch_and_ca_build_args_are_used_where_pip_runs() -> None:
    """The CA bundle is set up in the base stage (the wheel stage's pip needs PyPI too), and
    the cpu target installs a handed-in torch wheel instead of the index when there is one."""
    stages = dockerfile_stages()
    assert "${EXTRA_CA_CERTS}" in stages["base"] and "/etc/pip.conf" in stages["base"]
    cpu = stages["cpu"]
    assert "COPY ${TORCH_WHEELS}/" in cpu and "torch-${TORCH_VERSION}*.whl" in cpu
    assert cpu.index("COPY ${TORCH_WHEELS}/") < cpu.index("/wheels/qkscope")


def test_dockerignore_keeps_local_state_and_secrets_out_of_the_build_context() -> None:
    """The first real build sent .venv (GBs) and .git to the daemon; .env holds secrets."""
    rules = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    for path in (".git", ".venv", ".env", ".qkscope", "*.db"):
        assert path in rules, path
    # ...but never what the Dockerfile copies.
    for src in ("service", "workers", "migrations", "study_defs", "docker", "pyproject.toml"):
        assert not any(r.rstrip("/") == src for r in rules), src
    assert "!.smoke/torch-wheels" in rules and "!.smoke/extra-ca" in rules


def smoke_override() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "docker" / "smoke" / "compose.smoke.yml").read_text())
    assert isinstance(data, dict)
    return data


def test_smoke_override_has_two_cpu_workers_and_no_gpu(
    services: dict[str, dict[str, Any]],
) -> None:
    over = smoke_override()["services"]
    workers = [n for n, s in over.items() if argv_of(s)[:2] == ["ray", "start"]]
    assert len(workers) == 2
    head_port = flag(argv_of(services["ray-head"]), "--port")
    for name in workers:
        argv = argv_of(over[name])
        assert flag(argv, "--address") == f"ray-head:{head_port}"
        assert flag(argv, "--num-gpus") == "0" and "--block" in argv
        assert over[name]["image"] == "qkscope:cpu" and not gpu_devices(over[name])
        env = env_of(over[name])
        assert env["RAY_AUTH_MODE"] == "token" and is_reference(env["RAY_AUTH_TOKEN"])
        assert f"checkpoints:{env['QKSCOPE_CHECKPOINT_DIR']}" in over[name]["volumes"]
    assert over["ray-worker"]["profiles"]  # the GPU worker stays down
    assert "ports" not in over.get("api", {})  # compose appends ports: never add here


def test_host_ports_can_move_without_changing_the_defaults(
    services: dict[str, dict[str, Any]],
) -> None:
    """Another service on 8000/8265 must not stop the stack (the smoke run picks free ones)."""
    api = [str(p) for p in services["api"]["ports"]]
    head = [str(p) for p in services["ray-head"]["ports"]]
    assert any(REF.search(p.rsplit(":", 1)[0]) for p in api)
    assert any(REF.search(p.rsplit(":", 1)[0]) for p in head)


def test_smoke_postgres_is_initialised_utf8() -> None:
    """The first real run: initdb in a root file system without locales chose SQL_ASCII,
    psycopg returned text as bytes and the API died reading the server version."""
    script = (ROOT / "docker" / "smoke" / "postgres-entrypoint.sh").read_text()
    initdb = script[script.index("initdb ") :].split(">/dev/null", 1)[0]
    assert "--encoding=UTF8" in initdb and "UTF-8" in initdb.split("--locale=", 1)[1]


# --- scripts/compose-smoke's choices, without a Docker engine ------------------------------


def load_smoke(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """scripts/compose-smoke as a module, its log under tmp_path, no image env set."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader(
        "compose_smoke", str(ROOT / "scripts" / "compose-smoke")
    )
    spec = importlib.util.spec_from_loader("compose_smoke", loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    monkeypatch.setattr(mod, "SMOKE", tmp_path)
    for name in ("QKSCOPE_BASE_IMAGE", "SMOKE_POSTGRES_IMAGE"):  # the script sets them
        monkeypatch.setenv(name, "")  # recorded, so that the test's end restores them
        monkeypatch.delenv(name)
    return mod


class FakeDocker:
    """Stands in for the smoke script's `run`: records each command; `fails` names the
    command prefixes that exit 1 (a missing image, a daemon that does not answer)."""

    def __init__(self, fails: tuple[tuple[str, ...], ...] = ()) -> None:
        self.fails = fails
        self.cmds: list[list[str]] = []

    def __call__(self, cmd: list[str], **kw: Any) -> Any:
        import subprocess

        self.cmds.append(list(cmd))
        rc = 1 if any(tuple(cmd[: len(f)]) == f for f in self.fails) else 0
        if rc and kw.get("check", True):
            raise RuntimeError(f"{cmd} failed")
        return subprocess.CompletedProcess(cmd, rc, stdout="Cannot connect\n" if rc else "")


def test_smoke_postgres_does_not_assume_the_debian_image_a_given_base_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With QKSCOPE_BASE_IMAGE set, the base step never debootstraps; the PostgreSQL step
    built FROM qkscope-smoke-debian:bookworm anyway and failed where that image was never
    made. Now it makes the Debian image first, or says what to install or set."""
    smoke = load_smoke(monkeypatch, tmp_path)
    monkeypatch.setenv("QKSCOPE_BASE_IMAGE", "python:3.11-slim")
    inspect = ("docker", "image", "inspect", smoke.DEBIAN_IMAGE)
    docker = FakeDocker(fails=(inspect,))
    monkeypatch.setattr(smoke, "run", docker)
    monkeypatch.setattr(smoke.shutil, "which", lambda name, **kw: None)  # no debootstrap
    assert "given" in smoke.base_image() and docker.cmds == []
    with pytest.raises(smoke.SmokeError, match="debootstrap.*SMOKE_POSTGRES_IMAGE"):
        smoke.postgres_image()
    assert not any(c[:2] == ["docker", "build"] for c in docker.cmds), docker.cmds

    # With debootstrap: the Debian image is made before PostgreSQL is built from it.
    monkeypatch.setattr(smoke.shutil, "which", lambda name, **kw: f"/usr/sbin/{name}")
    imported: list[list[str]] = []

    class Tar:  # `tar -c` of the root file system, piped into `docker import`
        stdout = None

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(smoke.subprocess, "Popen", lambda *a, **kw: Tar())
    monkeypatch.setattr(smoke.subprocess, "run", lambda cmd, **kw: imported.append(cmd))
    docker.cmds.clear()
    smoke.postgres_image()
    tools = [c[0] if c[0] != "docker" else " ".join(c[:2]) for c in docker.cmds]
    assert tools.index("debootstrap") < tools.index("docker build"), docker.cmds
    assert imported == [["docker", "import", "-", smoke.DEBIAN_IMAGE]]
    assert f"DEBIAN_IMAGE={smoke.DEBIAN_IMAGE}" in docker.cmds[-1]


def test_smoke_postgres_image_can_be_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    smoke = load_smoke(monkeypatch, tmp_path)
    docker = FakeDocker()
    monkeypatch.setattr(smoke, "run", docker)
    monkeypatch.setenv("SMOKE_POSTGRES_IMAGE", "postgres:16")
    assert smoke.postgres_image() == "postgres:16 (given)" and docker.cmds == []
    assert smoke.Stack().env["SMOKE_POSTGRES_IMAGE"] == "postgres:16"
    image = smoke_override()["services"]["postgres"]["image"]
    assert REF.fullmatch(image)["name"] == "SMOKE_POSTGRES_IMAGE"  # type: ignore[index]
    assert with_defaults(image) == smoke.POSTGRES_IMAGE


def test_smoke_preflight_names_what_is_missing_and_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """It stopped at "neither docker compose nor docker-compose is installed" and said
    nothing of the daemon or debootstrap; now it names all of them, with the fix."""
    smoke = load_smoke(monkeypatch, tmp_path)
    monkeypatch.setattr(smoke, "run", FakeDocker())
    monkeypatch.setattr(smoke.shutil, "which", lambda name, **kw: None)
    missing = smoke.missing_tools()
    assert missing[-1] == "install: apt-get install -y docker.io docker-compose debootstrap"
    assert any("docker compose" in m and "docker-compose" in m for m in missing)
    with pytest.raises(smoke.SmokeError, match="not ready") as e:
        smoke.preflight()
    assert "apt-get install -y docker.io" in str(e.value)

    # The CLI and compose are there but the daemon does not answer; no debootstrap.
    present = {"docker", "docker-compose", "dockerd"}
    monkeypatch.setattr(
        smoke.shutil, "which", lambda name, **kw: f"/usr/bin/{name}" if name in present else None
    )
    monkeypatch.setattr(
        smoke,
        "run",
        FakeDocker(fails=(("docker", "info"), ("docker", "compose"), ("docker", "image"))),
    )
    missing = smoke.missing_tools()
    assert any("daemon does not answer" in m and "dockerd >" in m for m in missing), missing
    assert not any("docker-compose`" in m for m in missing)  # docker-compose is there
    assert missing[-1] == "install: apt-get install -y debootstrap"

    # Both images given: no debootstrap needed.
    monkeypatch.setenv("QKSCOPE_BASE_IMAGE", "python:3.11-slim")
    monkeypatch.setenv("SMOKE_POSTGRES_IMAGE", "postgres:16")
    assert not any("debootstrap" in m for m in smoke.missing_tools())
