"""docker/: the compose file and the Dockerfiles, checked without a Docker engine.

No engine runs on the development machines, so the images are never built here. These tests are
the proof of structure instead: each service of docker/compose.yaml runs a command that the
`refill` CLI really registers (parsed by the CLI's own click command, options and all), every
worker's role exists and consumes a queue the Celery app defines (and every queue has a
consumer), the GPU services reserve one GPU each, no password is written down, the start-up
order holds, and the run directory, models and data are where the config says. The Dockerfiles
are linted for what matters: they install refill, the CPU image takes torch from the CPU index
inside pyproject's range, both run as a non-root user with a health check.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import typer
import yaml
from packaging.requirements import Requirement

from refill.admin.cli import app as cli_app
from refill.tasks.app import make_app
from refill.tasks.workers import ROLES, worker_argv

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
CPU_DOCKERFILE = "docker/Dockerfile"
GPU_DOCKERFILE = "docker/Dockerfile.gpu"

#: What compose would put in for the one variable without a default.
PASSWORD = "sentinel-not-a-password"
REQUIRED = {"POSTGRES_PASSWORD": PASSWORD}

SERVICES = {"postgres", "redis", "migrate", "control", "consumer", "generate", "trainer", "start",
            "exporter", "prometheus", "flower"}
#: Optional services for watching a run (issue 19), started with `--profile observability`.
OBSERVABILITY = {"exporter", "prometheus", "flower"}
WORKER_SERVICES = {"control": "control", "consumer": "consume", "generate": "generate", "trainer": "train"}
GPU_SERVICES = {"generate", "trainer"}
ONE_SHOT = {"migrate", "start"}


# --- compose interpolation (the subset of the Compose spec this file uses) -------------------

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class MissingVariable(Exception):
    pass


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """`${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `${VAR?error}`, `$$`."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, arg = match.group(2), match.group(3)
        current = env.get(name)
        unset_or_empty = current is None or (current == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if unset_or_empty else current
        if op in (":?", "?"):
            if unset_or_empty:
                raise MissingVariable(f"{name}: {arg}")
            return current
        return current or ""

    return _VAR.sub(replace, value)


def raw_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose file with YAML anchors merged and variables interpolated (defaults)."""
    return interpolate(raw_compose(), REQUIRED if env is None else env)


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def dockerfile_of(service: dict[str, Any]) -> str | None:
    build = service.get("build")
    if build is None:
        return None
    assert isinstance(build, dict) and (DOCKER / build["context"]).resolve() == ROOT, build
    return build["dockerfile"]


def refill_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services().items() if dockerfile_of(s) is not None}


# --- the refill CLI, as click sees it ---------------------------------------------------------


def _is_group(command: Any) -> bool:
    return callable(getattr(command, "get_command", None)) and callable(getattr(command, "list_commands", None))


def resolve_command(argv: list[str]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """(the command's path, its parsed parameters) for `refill ARGS...`, as the CLI would parse
    them; fails when a group, command, option or argument does not exist or does not parse.

    Walks the command tree typer builds (`typer.main.get_command`); typer's command classes follow
    click's interface (recent typer ships its own copy of click), so only that interface is used:
    `get_command`/`list_commands` on groups, `make_context` on the leaf."""
    if not argv or argv[0] != "refill":
        pytest.fail(f"not a refill command: {argv}")
    root = typer.main.get_command(cli_app)
    ctx = root.context_class(root, info_name="refill")
    command: Any = root
    path: list[str] = []
    rest = list(argv[1:])
    while _is_group(command):
        if not rest:
            pytest.fail(f"{argv}: `refill {' '.join(path)}` needs a sub-command")
        name = rest.pop(0)
        sub = command.get_command(ctx, name)
        if sub is None:
            pytest.fail(
                f"{argv}: `refill {' '.join(path)}` has no command {name!r} "
                f"(it has: {', '.join(command.list_commands(ctx))})"
            )
        path.append(name)
        parent, command = ctx, sub
        ctx = command.context_class(command, info_name=name, parent=parent)
    try:
        parsed = command.make_context(path[-1], rest, parent=ctx.parent)
    except Exception as error:  # click's (or typer's copy of click's) usage errors
        message = error.format_message() if hasattr(error, "format_message") else repr(error)
        pytest.fail(f"{argv}: `refill {' '.join(path)}` rejects its arguments: {message}")
    return tuple(path), parsed.params


# --- Dockerfiles ------------------------------------------------------------------------------


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines: list[str] = []
    pending = ""
    for line in (ROOT / dockerfile).read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    out = []
    for line in lines:
        keyword, _, args = line.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def args_of(dockerfile: str, keyword: str) -> list[str]:
    return [args for kw, args in instructions(dockerfile) if kw == keyword]


def build_args(dockerfile: str) -> dict[str, str]:
    out = {}
    for args in args_of(dockerfile, "ARG"):
        name, _, default = args.partition("=")
        out[name] = default.strip('"')
    return out


def env_of(dockerfile: str) -> dict[str, str]:
    out = {}
    for args in args_of(dockerfile, "ENV"):
        for token in shlex.split(args):
            name, _, value = token.partition("=")
            out[name] = value
    return out


def pyproject_requirement(name: str, extra: str | None = None) -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["optional-dependencies"][extra] if extra else project["dependencies"]
    for dep in deps:
        requirement = Requirement(dep)
        if requirement.name == name:
            return requirement
    raise AssertionError(f"pyproject.toml has no {name} requirement")


def dockerignored(path: str) -> bool:
    """Whether the root .dockerignore keeps `path` out of the build context (Docker's rules for
    the patterns used there: a pattern matches a path or any of its parents; `**/` any depth;
    `!` re-includes)."""
    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.strip().startswith("#")
    ]
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        forms = [pattern] + ([pattern[3:]] if pattern.startswith("**/") else [])
        for candidate in candidates:
            if any(fnmatch.fnmatchcase(candidate, form) for form in forms) or (
                pattern.startswith("**/") and fnmatch.fnmatchcase(candidate.split("/")[-1], pattern[3:])
            ):
                ignored = not negate
                break
    return ignored


def workdir(dockerfile: str) -> str:
    return args_of(dockerfile, "WORKDIR")[-1]


def healthcheck_module() -> Any:
    spec = importlib.util.spec_from_file_location("refill_docker_healthcheck", DOCKER / "healthcheck.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of a service's short-syntax volumes."""
    out = {}
    for volume in service.get("volumes", []):
        assert isinstance(volume, str), f"use the short volume syntax: {volume}"
        source, target, *_ = volume.split(":")
        out[target] = source
    return out


def read_only(service: dict[str, Any], target: str) -> bool:
    return any(v.split(":")[1] == target and v.split(":")[2:] == ["ro"] for v in service.get("volumes", []))


def mounted_under(service: dict[str, Any], path: str) -> str | None:
    """The mount target that holds `path` in a service, if any."""
    for target in mounts(service):
        if PurePosixPath(path).is_relative_to(target):
            return target
    return None


def run_config(name: str) -> dict[str, Any]:
    """A config file as the start container reads it (its `${VAR:-default}` at defaults)."""
    return interpolate(yaml.safe_load((ROOT / "configs" / name).read_text()), {})


# --- the services -----------------------------------------------------------------------------


def test_compose_has_the_fleet() -> None:
    assert set(services()) == SERVICES
    # Prometheus and Flower run their own images, as PostgreSQL and Redis do.
    assert set(refill_services()) == SERVICES - {"postgres", "redis"} - {"prometheus", "flower"}


def test_every_refill_service_runs_a_registered_refill_command() -> None:
    seen = {}
    for name, service in refill_services().items():
        command = service.get("command")
        assert isinstance(command, list) and all(isinstance(a, str) for a in command), (
            f"{name}: command must be an exec-form list, got {command!r}"
        )
        seen[name] = resolve_command(command)[0]
    assert seen == {
        "migrate": ("db", "upgrade"),
        "control": ("worker",),
        "consumer": ("worker",),
        "generate": ("worker",),
        "trainer": ("worker",),
        "start": ("run", "start"),
        "exporter": ("exporter",),
    }


def test_the_resolver_rejects_what_the_cli_does_not_have() -> None:
    for argv in (["celery", "worker"], ["refill", "worker"], ["refill", "wrker", "generate"],
                 ["refill", "db", "migrate"], ["refill", "db"], ["refill", "run", "start"],
                 ["refill", "worker", "generate", "--threads", "4"],
                 ["refill", "worker", "generate", "--concurrency", "many"]):
        with pytest.raises(pytest.fail.Exception):
            resolve_command(argv)


def test_worker_roles_exist_and_consume_the_apps_queues() -> None:
    queues = {queue.name for queue in make_app("memory://").conf.task_queues}
    consumed = set()
    for name, role in WORKER_SERVICES.items():
        path, params = resolve_command(services()[name]["command"])
        assert path == ("worker",)
        assert params["role"] == role, f"{name} runs role {params['role']!r}"
        assert params["role"] in ROLES, f"{name}: no role {params['role']!r} in refill.tasks.workers.ROLES"
        queue = ROLES[params["role"]].queue
        assert queue in queues, f"{name} consumes {queue!r}, which the Celery app does not define"
        consumed.add(queue)
    assert consumed == queues, f"queues nobody consumes: {sorted(queues - consumed)}"


def test_generators_keep_many_groups_in_flight() -> None:
    # Each thread runs one bundle of up to GENERATE_BUNDLE attempts: the threads times the
    # bundle are the groups the engine can batch, the config's groups_in_flight.
    from refill.tasks.relay import GENERATE_BUNDLE

    _, params = resolve_command(services()["generate"]["command"])
    in_flight = run_config("qwen-math-vllm.yaml")["generation"]["groups_in_flight"]
    assert params["concurrency"] * GENERATE_BUNDLE == in_flight


def test_gpu_services_reserve_one_gpu_each_and_not_the_same_one() -> None:
    gpus = {}
    for name, service in services().items():
        devices = (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices")
        if name not in GPU_SERVICES:
            assert not devices, f"{name} reserves a GPU"
            continue
        assert dockerfile_of(service) == GPU_DOCKERFILE, name
        assert isinstance(devices, list) and len(devices) == 1, f"{name}: one device request"
        device = devices[0]
        assert device["driver"] == "nvidia", name
        assert "gpu" in device["capabilities"], name
        # One process per GPU: either one GPU by count (always the first one, in Docker) or one
        # named GPU.
        if "count" in device:
            assert "device_ids" not in device and device["count"] == 1, name
            gpus[name] = "0"
        else:
            assert len(device["device_ids"]) == 1, f"{name}: one GPU per process"
            gpus[name] = str(device["device_ids"][0])
        assert int(service.get("shm_size", "0").rstrip("gbmk") or 0) > 0, f"{name}: vLLM/torch need shm"
    assert set(gpus) == GPU_SERVICES
    assert len(set(gpus.values())) == len(gpus), f"GPU services share a GPU by default: {gpus}"


def test_cpu_services_use_the_cpu_image() -> None:
    for name, service in refill_services().items():
        if name not in GPU_SERVICES:
            assert dockerfile_of(service) == CPU_DOCKERFILE, name


def test_no_password_is_written_down() -> None:
    text = COMPOSE.read_text()
    url_userinfo = re.compile(r"[a-z][a-z0-9+.-]*://([^/@\s:]*):([^/@\s]*)@", re.I)

    def walk(value: Any, key: str = "") -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, str(k))
        elif isinstance(value, list):
            for v in value:
                walk(v, key)
        elif isinstance(value, str):
            for match in url_userinfo.finditer(value):
                assert re.fullmatch(r"\$\{[A-Z_]+(:\?[^}]*)?\}", match.group(2)), (
                    f"a URL with a literal password: {value}"
                )
            if re.search(r"pass(word)?|secret|token", key, re.I):
                assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]*\}", value), f"{key}: {value!r} is not from the environment"

    walk(raw_compose())
    assert not re.search(r"(password|secret)\s*[:=]\s*['\"]?(?!\$\{)\w", text.split("\nservices:", 1)[1], re.I)
    # The password reaches both sides from the one variable, which compose refuses to run without.
    resolved = services()
    assert resolved["postgres"]["environment"]["POSTGRES_PASSWORD"] == PASSWORD
    for name in refill_services():
        url = resolved[name]["environment"]["REFILL_DATABASE_URL"]
        assert url.startswith("postgresql+psycopg://") and f":{PASSWORD}@" in url, (name, url)
        assert resolved[name]["environment"]["REFILL_BROKER_URL"].startswith("redis://"), name
    with pytest.raises(MissingVariable, match="POSTGRES_PASSWORD"):
        compose(env={})
    example = (DOCKER / ".env.example").read_text()
    assert re.search(r"^POSTGRES_PASSWORD=$", example, re.M), ".env.example must not hold a password"
    assert ".env" in (DOCKER / ".gitignore").read_text().split()


def test_the_ledger_and_broker_urls_match_the_postgres_service() -> None:
    resolved = services()
    pg = resolved["postgres"]["environment"]
    url = resolved["control"]["environment"]["REFILL_DATABASE_URL"]
    assert url == f"postgresql+psycopg://{pg['POSTGRES_USER']}:{PASSWORD}@postgres:5432/{pg['POSTGRES_DB']}"
    assert resolved["control"]["environment"]["REFILL_BROKER_URL"] == "redis://redis:6379/0"


def has_healthcheck(service: dict[str, Any]) -> bool:
    check = service.get("healthcheck")
    if check is not None:
        return not check.get("disable") and check.get("test") not in (["NONE"], "NONE")
    dockerfile = dockerfile_of(service)
    return bool(dockerfile and args_of(dockerfile, "HEALTHCHECK"))


def test_depends_on_waits_for_health_and_for_the_migration() -> None:
    resolved = services()
    for name, service in resolved.items():
        for target, spec in (service.get("depends_on") or {}).items():
            assert target in resolved, f"{name} depends on a missing service {target}"
            assert isinstance(spec, dict) and "condition" in spec, f"{name} -> {target}: give a condition"
            condition = spec["condition"]
            if condition == "service_healthy":
                assert has_healthcheck(resolved[target]), f"{name} waits for {target}'s health, which has no check"
            elif condition == "service_completed_successfully":
                assert target in ONE_SHOT, f"{name} waits for {target} to exit, but it is long-running"
            else:
                pytest.fail(f"{name} -> {target}: condition {condition!r}")

    def deps(name: str) -> dict[str, str]:
        return {t: s["condition"] for t, s in (resolved[name].get("depends_on") or {}).items()}

    assert deps("migrate") == {"postgres": "service_healthy"}
    for name in WORKER_SERVICES:
        assert deps(name) == {
            "postgres": "service_healthy",
            "redis": "service_healthy",
            "migrate": "service_completed_successfully",
        }, name
    assert deps("start") == {
        "postgres": "service_healthy",
        "redis": "service_healthy",
        "migrate": "service_completed_successfully",
        "control": "service_healthy",  # a detached run is driven by the control workers
    }
    assert not deps("postgres") and not deps("redis")


def test_one_shot_jobs_and_long_running_services() -> None:
    resolved = services()
    for name, service in resolved.items():
        if name in ONE_SHOT:
            assert service.get("restart") == "no", f"{name} would be restarted after it finished"
            assert service["healthcheck"] == {"disable": True}, f"{name} runs no worker to ping"
        else:
            assert service.get("restart") == "unless-stopped", name
            assert has_healthcheck(service), name
    for name in WORKER_SERVICES:
        assert resolved[name].get("init") is True, f"{name}: reap vLLM's and Celery's children"
    profiled = {name for name, s in resolved.items() if s.get("profiles")}
    assert profiled == {"start"} | OBSERVABILITY and resolved["start"]["profiles"] == ["start"]
    for name in OBSERVABILITY:
        assert resolved[name]["profiles"] == ["observability"], name


def test_start_submits_the_qwen_config_detached() -> None:
    start = services()["start"]
    path, params = resolve_command(start["command"])
    assert path == ("run", "start") and params["detach"] is True
    config = PurePosixPath(str(params["config_path"]))
    assert str(config) == "/configs/qwen-math-vllm.yaml"
    source = mounts(start)["/configs"]
    assert (DOCKER / source / config.name).is_file()
    # The same configs are baked into both images.
    for dockerfile in (CPU_DOCKERFILE, GPU_DOCKERFILE):
        assert "configs /configs" in args_of(dockerfile, "COPY"), dockerfile


def test_run_directory_is_one_shared_volume_at_one_path() -> None:
    # run.output_dir is relative; `refill run start` resolves it against its working directory
    # and records the absolute path that workers then read from the ledger.
    assert workdir(CPU_DOCKERFILE) == workdir(GPU_DOCKERFILE)
    for config in ("qwen-math-vllm.yaml", "sim-fleet.yaml"):
        output_dir = PurePosixPath(workdir(CPU_DOCKERFILE)) / run_config(config)["run"]["output_dir"]
        sources = set()
        for name, service in refill_services().items():
            assert "working_dir" not in service, f"{name}: keep the images' working directory"
            target = mounted_under(service, str(output_dir))
            assert target is not None, f"{name} does not see {output_dir}"
            sources.add(mounts(service)[target])
        assert sources == {"runs"}, sources
    assert "runs" in compose()["volumes"]


def test_models_and_data_are_mounted_where_the_config_reads_them() -> None:
    resolved = services()
    config = run_config("qwen-math-vllm.yaml")
    model, data = config["model"]["name_or_path"], config["data"]["train_path"]
    for name in ("start", "generate", "trainer"):
        target = mounted_under(resolved[name], model)
        assert target == "/weights", f"{name} cannot read {model}"
        assert read_only(resolved[name], target), f"{name} mounts the models writable"
    assert mounted_under(resolved["start"], data) == "/data" and read_only(resolved["start"], "/data")


def test_postgres_and_redis_keep_their_data() -> None:
    resolved = services()
    assert "/var/lib/postgresql/data" in mounts(resolved["postgres"])
    assert resolved["postgres"]["image"].split(":")[1].split("-")[0] == "16"  # data path above is 16's
    assert "/data" in mounts(resolved["redis"])
    assert "--appendonly" in resolved["redis"]["command"]
    assert {"pgdata", "redisdata"} <= set(compose()["volumes"])


# --- the Dockerfiles --------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", [CPU_DOCKERFILE, GPU_DOCKERFILE])
def test_images_install_refill_and_run_as_a_user(dockerfile: str) -> None:
    copies = args_of(dockerfile, "COPY")
    assert "pyproject.toml /src/pyproject.toml" in copies and "refill /src/refill" in copies
    installs = [run for run in args_of(dockerfile, "RUN") if re.search(r"pip install .*/src\b", run)]
    assert installs, f"{dockerfile} does not install refill"
    assert "import torch" in installs[0] and "refill.admin.cli" in installs[0], "the install is smoke-tested"
    user = args_of(dockerfile, "USER")[-1]
    assert user not in ("root", "0") and not user.startswith("0:"), f"{dockerfile} runs as {user}"
    assert env_of(dockerfile).get("PYTHONUNBUFFERED") == "1"
    health = args_of(dockerfile, "HEALTHCHECK")
    assert len(health) == 1 and "refill-healthcheck" in health[0]
    assert "docker/healthcheck.py /usr/local/bin/refill-healthcheck" in copies
    assert args_of(dockerfile, "CMD")[-1] == '["refill", "--help"]'
    for copy in copies:
        *sources, _ = copy.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile} copies missing {source}"
            assert not dockerignored(source), f".dockerignore drops {source}, which {dockerfile} copies"


def test_cpu_image_takes_torch_from_the_cpu_index_within_pyprojects_range() -> None:
    assert args_of(CPU_DOCKERFILE, "FROM") == ["python:3.11-slim"]
    torch = pyproject_requirement("torch")
    version = build_args(CPU_DOCKERFILE)["TORCH_VERSION"]
    assert torch.specifier.contains(version), f"TORCH_VERSION {version} is outside pyproject's {torch}"
    runs = " ".join(args_of(CPU_DOCKERFILE, "RUN"))
    assert build_args(CPU_DOCKERFILE)["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert re.search(r'pip install --index-url "\$\{TORCH_INDEX_URL\}" "torch==\$\{TORCH_VERSION\}"', runs)
    # refill's own install holds that torch, so pip cannot swap in PyPI's CUDA build.
    assert "--constraint /tmp/torch.txt /src" in runs and "assert not torch.version.cuda" in runs
    body = "\n".join(f"{kw} {args}" for kw, args in instructions(CPU_DOCKERFILE))
    assert not re.search(r"cuda|nvidia|cu1\d\d|\[vllm\]", body.replace("torch.version.cuda", ""), re.I)


def test_gpu_image_is_vllm_with_the_vllm_extra() -> None:
    froms = args_of(GPU_DOCKERFILE, "FROM")
    assert froms == ["vllm/vllm-openai:v${VLLM_VERSION}"]
    version = build_args(GPU_DOCKERFILE)["VLLM_VERSION"]
    assert pyproject_requirement("vllm", extra="vllm").specifier.contains(version)
    runs = " ".join(args_of(GPU_DOCKERFILE, "RUN"))
    assert 'pip install --constraint /tmp/pins.txt "/src[vllm]"' in runs
    assert args_of(GPU_DOCKERFILE, "ENTRYPOINT") == ["[]"], "reset the vLLM server's entrypoint"
    assert env_of(GPU_DOCKERFILE).get("VLLM_NO_USAGE_STATS") == "1"
    assert build_args(GPU_DOCKERFILE)["REFILL_UID"] == build_args(CPU_DOCKERFILE)["REFILL_UID"]


def test_build_context_leaves_out_the_heavy_and_the_secret() -> None:
    for path in (".git", ".venv", "runs", "weights/Qwen/model.safetensors", "data/math/train.jsonl",
                 "docker/.env", "refill/__pycache__/x.pyc", "refill.egg-info", "runs/refill.db"):
        assert dockerignored(path), path
    for path in ("pyproject.toml", "tasks/app.py", "refill/assets/tiny-arith/tokenizer.json",
                 "migrations/versions/0001_ledger.py", "models/tables.py", "trainer/grpo.py",
                 "admin/cli.py", "configs/qwen-math-vllm.yaml",
                 "docker/healthcheck.py"):
        assert not dockerignored(path), path


# --- the health check -------------------------------------------------------------------------


def test_healthcheck_pings_the_node_names_refill_worker_gives() -> None:
    from celery.utils.nodenames import default_nodename, host_format

    module = healthcheck_module()
    nodes = module.candidate_nodes(environ={}, host="c0ffee")
    for role in ROLES:
        argv = worker_argv(role)
        hostname = argv[argv.index("--hostname") + 1]
        # What `celery worker --hostname` makes of it (celery.bin.worker.Hostname).
        assert host_format(default_nodename(hostname), host="c0ffee") in nodes
    assert module.candidate_nodes(environ={"REFILL_HEALTHCHECK_NODE": "gen-a@%h"}, host="c0ffee") == ["gen-a@c0ffee"]


def test_healthcheck_without_a_broker_is_unhealthy(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv("REFILL_BROKER_URL", raising=False)
    assert healthcheck_module().main() == 1
    assert "REFILL_BROKER_URL" in capsys.readouterr().err


# --- watching the fleet (profile observability, issue 19) --------------------------------------


def test_the_exporter_serves_where_prometheus_scrapes_and_its_check_looks() -> None:
    resolved = services()
    exporter = resolved["exporter"]
    _, params = resolve_command(exporter["command"])
    port = params["port"]
    assert exporter["ports"] == [f"{port}:{port}"]
    # Its own check, not the image's (which pings a Celery worker the exporter does not run).
    check = " ".join(exporter["healthcheck"]["test"])
    assert f"http://localhost:{port}/metrics" in check
    # The ledger and the broker it reads are the fleet's.
    for key in ("REFILL_DATABASE_URL", "REFILL_BROKER_URL"):
        assert exporter["environment"][key] == resolved["control"]["environment"][key]
    prometheus = resolved["prometheus"]
    config_path = next(v for v in prometheus["volumes"] if v.endswith(":/etc/prometheus/prometheus.yml:ro"))
    scrape = yaml.safe_load((DOCKER / config_path.split(":")[0]).read_text())
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    (job,) = scrape["scrape_configs"]
    assert job["static_configs"] == [{"targets": [f"exporter:{port}"]}]
    assert scrape["global"]["scrape_interval"] == "15s"
    assert "prometheusdata" in compose()["volumes"] and "/prometheus" in mounts(prometheus)


def test_flower_reads_the_fleets_broker() -> None:
    resolved = services()
    flower = resolved["flower"]
    command = flower["command"]
    assert command[0] == "celery" and "flower" in command
    broker = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--broker="))
    assert broker == resolved["control"]["environment"]["REFILL_BROKER_URL"]
    port = int(next(arg.split("=", 1)[1] for arg in command if arg.startswith("--port=")))
    assert flower["ports"] == [f"{port}:{port}"]
    assert f"http://localhost:{port}/healthcheck" in " ".join(flower["healthcheck"]["test"])
    assert (flower.get("depends_on") or {}) == {"redis": {"condition": "service_healthy"}}


def test_task_events_are_off_unless_the_environment_turns_them_on() -> None:
    from refill.tasks.app import EVENTS_ENV

    for name in WORKER_SERVICES:
        assert services()[name]["environment"][EVENTS_ENV] == "0", name
    on = compose(env={**REQUIRED, EVENTS_ENV: "1"})["services"]
    assert all(on[name]["environment"][EVENTS_ENV] == "1" for name in WORKER_SERVICES)


def test_the_grafana_dashboard_reads_only_metrics_the_exporter_serves() -> None:
    import json

    from refill.admin.exporter import LedgerCollector
    from refill.models.db import Ledger
    from refill.models.tables import Base

    class Queues:
        def lengths(self) -> dict[str, int]:
            return {"generate": 0}

    ledger = Ledger("sqlite://")
    Base.metadata.create_all(ledger.engine)
    served = set()
    for family in LedgerCollector(ledger, Queues(), recent_minutes=60).collect():  # type: ignore[arg-type]
        # A counter family is named without the _total its samples are served with.
        served.add(family.name + ("_total" if family.type == "counter" else ""))
    ledger.dispose()
    dashboard = json.loads((DOCKER / "grafana-dashboard.json").read_text())
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"\brefill_[a-z_]+", target["expr"]))
    variables = " ".join(v.get("query", "") for v in dashboard["templating"]["list"])
    used |= set(re.findall(r"\brefill_[a-z_]+", variables))
    assert used and used <= served, sorted(used - served)
    # Counters are served with their _total suffix and the dashboard reads them so.
    assert "refill_steps_trained_total" in used


def test_fleet_wide_settings_reach_every_refill_service_and_the_qwen_paths_reach_start() -> None:
    """Setting them in docker/.env did nothing: compose passes a service only the variables its
    file names (the README says to set these alike on every process)."""
    fleet_wide = ("REFILL_BROKER_PREFIX", "REFILL_QUEUED_PER_SHARE", "REFILL_VISIBILITY_TIMEOUT")
    for name, service in refill_services().items():
        for variable in fleet_wide:
            assert service["environment"][variable] == "", (name, variable)  # empty: the default
    given = {"REFILL_BROKER_PREFIX": "fleet-a:", "REFILL_QUEUED_PER_SHARE": "64", "REFILL_VISIBILITY_TIMEOUT": "7200",
             "REFILL_MODEL_PATH": "/weights/other", "REFILL_TRAIN_PATH": "/data/other.jsonl"}
    resolved = compose(env={**REQUIRED, **given})["services"]
    for name in refill_services():
        assert {v: resolved[name]["environment"][v] for v in fleet_wide} == {v: given[v] for v in fleet_wide}, name
    start = resolved["start"]["environment"]
    assert (start["REFILL_MODEL_PATH"], start["REFILL_TRAIN_PATH"]) == ("/weights/other", "/data/other.jsonl")
    assert start["REFILL_DATABASE_URL"] == resolved["control"]["environment"]["REFILL_DATABASE_URL"]
    # The Qwen config reads them as ${VAR:-default}: empty (not set in .env) is its default.
    assert "${REFILL_MODEL_PATH:-" in (ROOT / "configs" / "qwen-math-vllm.yaml").read_text()
