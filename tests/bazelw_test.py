"""./bazelw on a machine without Bazel: one line while it installs Debian's packages, apt's output kept in a log
that a failure names. Runs bazelw against stub apt-get / bazel commands on a PATH that has no Bazel."""

import os
import shutil
import subprocess
from pathlib import Path

BAZELW = Path(__file__).resolve().parents[1] / "bazelw"


def _stub(d: Path, name: str, body: str):
    p = d / name
    p.write_text("#!" + shutil.which("bash") + "\n" + body)
    p.chmod(0o755)


def _run(tmp_path, apt_rc: int):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id", "tail"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    _stub(bin_dir, "gcc", "exit 0\n")
    # apt-get prints what dpkg prints (many lines); `install` puts a bazel on PATH.
    _stub(bin_dir, "apt-get", f"""for i in $(seq 1 50); do echo "Unpacking package $i ..."; done
if [ "$1" = install ]; then printf '#!{shutil.which("bash")}\\necho "bazel ran: $*"\\n' > {bin_dir}/bazel
  chmod +x {bin_dir}/bazel; echo "E: disk full" >&2; exit {apt_rc}; fi
""")
    os.symlink(shutil.which("seq"), bin_dir / "seq")
    os.symlink(shutil.which("printf") or "/usr/bin/printf", bin_dir / "printf")
    os.symlink(shutil.which("chmod"), bin_dir / "chmod")
    env = {"PATH": str(bin_dir), "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
    return subprocess.run([str(BAZELW), "version"], env=env, capture_output=True, text=True, timeout=60)


def test_install_prints_one_line_and_keeps_the_log(tmp_path):
    r = _run(tmp_path, apt_rc=0)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [f"bazelw: installing bazel-bootstrap bazel-rules-java (Debian packages; log: "
                                     f"{tmp_path}/bazelw-install.log)"]
    assert r.stdout == "bazel ran: version\n"
    assert (tmp_path / "bazelw-install.log").read_text().count("Unpacking package") == 100  # update + install


def test_failed_install_names_the_log_and_shows_its_end(tmp_path):
    r = _run(tmp_path, apt_rc=100)
    assert r.returncode == 1
    assert f"failed; the last lines of {tmp_path}/bazelw-install.log:" in r.stderr
    assert "E: disk full" in r.stderr and "bazel ran" not in r.stdout
