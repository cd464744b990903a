"""Redaction: every credential form a setup line or command line may carry is replaced; ordinary values are kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from taxbench.redaction import REDACTED, is_secret_name, redact, redact_text

# (line, the secret it holds, what the redacted line must still say)
SECRET_LINES = [
    ("export MYPASS=hunter2x", "hunter2x", "export MYPASS="),
    ("export DB_PWD=pwsecret1", "pwsecret1", "export DB_PWD="),
    ('curl -H "Authorization: Bearer tok123abc" https://x', "tok123abc", '-H "Authorization: <redacted>"'),
    ("curl -H 'Authorization: Basic dXNlcjpwdw==' x", "dXNlcjpwdw==", "Authorization: <redacted>'"),
    ('curl -H "Cookie: a=b; c=d" x', "c=d", '"Cookie: <redacted>"'),
    ("token header: Bearer abcdef123", "abcdef123", "Bearer <redacted>"),
    ("docker login -u me -p dockpw123 registry.example.com", "dockpw123", "-u me -p <redacted> registry.example.com"),
    ("export GITLAB_PAT=glpat-ABCDEFGHIJKLMNOPQRSTUV", "glpat-ABCDEFGHIJKLMNOPQRSTUV", "export GITLAB_PAT="),
    ("git clone https://gitlab.com/x glpat-ABCDEFGHIJKLMNOPQRST12", "glpat-ABCDEFGHIJKLMNOPQRST12", "git clone"),
    ("mysql -h db -u root -pMyS3cret dbname", "MyS3cret", "-u root -p<redacted> dbname"),
    ("mariadb-dump -pMaria1 db > x.sql", "Maria1", "-p<redacted> db"),
    ("curl -u alice:curlpw1 https://x", "curlpw1", "-u alice:<redacted> https://x"),
    ("curl --user 'bob:curl pw2' x", "curl pw2", "--user 'bob:<redacted>' x"),
    ("redis-cli -u redis://:redpw1@host:6379", "redpw1", "redis://:<redacted>@host:6379"),
    ("echo sk_live_51Habcdefghijklmno", "sk_live_51Habcdefghijklmno", "echo"),
    ("echo sk_test_51Habcdefghijklmno", "sk_test_51Habcdefghijklmno", "echo"),
    ("echo rk_live_51Habcdefghijklmno", "rk_live_51Habcdefghijklmno", "echo"),
    ("tool --password pw7 --verbose", "pw7", "--password <redacted> --verbose"),
    ("tool --key kk8 x", "kk8", "--key <redacted> x"),
    ("tool --key=kk9", "kk9", "--key=<redacted>"),
    ('tool --password "p w 0"', "p w 0", '--password "<redacted>"'),
    ('export TOKEN="a b c"; echo', "a b c", 'export TOKEN="<redacted>"; echo'),
    ("export TOKEN='d e f'", "d e f", "export TOKEN='<redacted>'"),
    ('export SECRET="g \\"h\\" i"', 'h\\" i', 'export SECRET="<redacted>"'),
    ('env "API_TOKEN=j k l" cmd', "j k l", 'env "API_TOKEN=<redacted>" cmd'),
    ('{"TOKEN": "m n o"}', "m n o", '{"TOKEN": "<redacted>"}'),
]


@pytest.mark.parametrize(("line", "secret", "kept"), SECRET_LINES, ids=[s[0][:40] for s in SECRET_LINES])
def test_each_credential_form_is_redacted(line: str, secret: str, kept: str) -> None:
    clean = redact_text(line)
    assert secret not in clean and REDACTED in clean
    assert kept in clean, clean
    assert redact_text(clean) == clean  # redacting twice changes nothing (stored configs are compared redacted)


@pytest.mark.parametrize("quote", ['"', "'"])
def test_quoted_values_with_spaces_are_redacted_whole(quote: str) -> None:
    clean = redact_text(f"export TOKEN={quote}first second third{quote} && run")
    for word in ("first", "second", "third"):
        assert word not in clean
    assert clean == f"export TOKEN={quote}{REDACTED}{quote} && run"


@pytest.mark.parametrize(
    "line",
    ["python train.py max_tokens=5 --tokens-per-shard 100 --keep 3", "module load cuda/12.4", "ssh -p 22 host",
     "mysql -p dbname", "export BYPASS_CACHE=1", "srun --ntasks 4 --cpus-per-task=8 python x.py",
     "export PATH=/opt/bin:$PATH", "https://example.com:8443/data"],
)
def test_ordinary_lines_are_kept(line: str) -> None:
    assert redact_text(line) == line


@pytest.mark.parametrize("name", ["MYPASS", "DB_PWD", "GITLAB_PAT", "key", "--key", "SSH_KEY", "PGPASSWORD",
                                  "accessToken", "WANDB_API_KEY"])
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["max_tokens", "tokens", "--tokens-per-shard", "--keep", "BYPASS", "path", "keys"])
def test_names_that_are_not_secret(name: str) -> None:
    assert not is_secret_name(name)


def test_mapping_values_under_secret_names_are_redacted() -> None:
    clean = redact({"env": {"MYPASS": "p1", "GITLAB_PAT": "p2", "NCCL_ALGO": "Ring"}, "max_tokens": 5})
    assert clean == {"env": {"MYPASS": REDACTED, "GITLAB_PAT": REDACTED, "NCCL_ALGO": "Ring"}, "max_tokens": 5}


# ---------------------------------------------------------------------------------------- nothing secret on disk
# Setup lines as a user would write them (the local launchers ignore setup, but every record carries the config),
# each with the secret values it holds. Hydra list syntax: each line quoted, the other quote kind inside.
SETUP_SECRETS: dict[str, tuple[str, ...]] = {
    "'export MYPASS=mypass-v4lue'": ("mypass-v4lue",),
    "'curl -H \"Authorization: Bearer bearer-v4lue-123\" https://example.com'": ("bearer-v4lue-123",),
    "'docker login -u me -p dockerpw-v4lue registry.example.com'": ("dockerpw-v4lue",),
    "'export GITLAB_PAT=glpat-Gl4bT0kenV4lue12345678'": ("glpat-Gl4bT0kenV4lue12345678", "Gl4bT0kenV4lue"),
    "'mysql -u root -pmysqlpw-v4lue db'": ("mysqlpw-v4lue",),
    "'curl -u alice:curlpw-v4lue https://example.com'": ("curlpw-v4lue",),
    "'redis-cli -u redis://:redispw-v4lue@localhost:6379'": ("redispw-v4lue",),
    "'echo sk_live_StripeV4lue1234567890'": ("StripeV4lue1234567890",),
    "'tool --password optpw-v4lue --key optkey-v4lue'": ("optpw-v4lue", "optkey-v4lue"),
    "'export TOKEN=\"dqone dqtwo dqthree\"'": ("dqone", "dqtwo", "dqthree"),
    "\"export SECRET='sqone sqtwo sqthree'\"": ("sqone", "sqtwo", "sqthree"),
}
SECRETS = [secret for secrets in SETUP_SECRETS.values() for secret in secrets]


def files_holding_secrets(root: Path) -> dict[str, list[str]]:
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            hits = [s for s in SECRETS if s.encode() in data]
            if hits:
                found[str(path.relative_to(root))] = hits
    return found


@pytest.mark.slow
def test_no_setup_secret_reaches_any_file_of_an_experiment(tmp_path: Path, taxbench_cli) -> None:
    setup = "cluster.setup=[module load cuda," + ",".join(SETUP_SECRETS) + "]"
    done = taxbench_cli(
        "cluster=inprocess", f"experiment.out_dir={tmp_path}", "experiment.name=secrets", setup,
        "experiment.steps=12", "experiment.block_steps=6", "experiment.warmup_steps=2", "experiment.resume_step=6",
        "report.wandb=true", "report.html=true", cwd=tmp_path, timeout=300, env={"WANDB_MODE": "offline"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    root = tmp_path / "secrets"
    manifest = json.loads((root / "deterministic-0" / "manifest.json").read_text())
    recorded = manifest["config"]["cluster"]["setup"]
    assert recorded[0] == "module load cuda" and len(recorded) == 1 + len(SETUP_SECRETS)  # the lines are recorded
    written = {p.relative_to(root).parts[0] for p in root.rglob("*") if p.is_file()}
    assert {"deterministic-0", "summary.json", "wandb"} <= written, written  # the files we grep exist
    assert list((root / "wandb").rglob("*.wandb")) and list((root / "wandb").rglob("debug*.log"))
    assert files_holding_secrets(root) == {}
    assert not any(secret in done.stdout + done.stderr for secret in SECRETS)


@pytest.mark.slow
def test_no_setup_secret_reaches_hydras_copy_of_a_sweep_config(tmp_path: Path, taxbench_cli) -> None:
    setup = "cluster.setup=[" + ",".join(SETUP_SECRETS) + "]"
    done = taxbench_cli(
        "-m", "cluster=inprocess", f"experiment.out_dir={tmp_path}", "experiment.name=sweep", setup,
        "experiment.steps=12", "experiment.block_steps=6", "experiment.warmup_steps=2", "experiment.resume_step=6",
        "experiment.order_seed=0", "report.wandb=false", cwd=tmp_path, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    saved = tmp_path / "sweep" / "multirun.yaml"
    assert saved.is_file() and not saved.is_symlink() and "<redacted>" in saved.read_text()
    assert (tmp_path / "sweep" / "point0" / "summary.json").is_file()
    assert files_holding_secrets(tmp_path / "sweep") == {}


def test_long_values_are_redacted_in_linear_time() -> None:
    """A long config value (a path list, an embedded file) must not hang every manifest write: the quadratic
    patterns took minutes on 100,000 characters; linear ones take milliseconds."""
    import time

    # CPU seconds of this process, not wall-clock: other jobs on the machine do not add to them.
    started = time.process_time()
    for text in ("a" * 200_000, "x=1 " * 50_000, "https://" + "a" * 200_000):
        redact_text(text)
    assert time.process_time() - started < 10
