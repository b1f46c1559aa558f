"""How a job's environment is built, in a box of its own (`environments.py`):
`python -m services.node.environment_build UV PYTHON REQUIREMENTS ENV SITE...`.

ENV becomes a virtual environment of PYTHON (the node's interpreter) over the node's packages
(each SITE, its site-packages, added after the environment's own): a job sees the node's torch and
goodput_train unless it asks for another version. uv installs REQUIREMENTS into it and resolves them
against the node's packages as installed (their metadata is copied in, their files are not), so a
package the node has in a version that satisfies the job is not fetched again; one it asks in
another version is installed in ENV, before the node's on the import path. uv reads no
configuration file (the index is the node's, from its UV_* settings), caches under HOME, the
build's own folder, removed after, and installs wheels only: no package's own code (an sdist's
build backend) runs while an environment is built."""

import shutil
import subprocess
import sys
from pathlib import Path

NODE_PATH_FILE = "_goodput_node.pth"


def main() -> int:
    uv, python, requirements, env, *sites = sys.argv[1:]
    common = ["--no-config", "--no-progress", "--color", "never"]
    subprocess.run([uv, "venv", *common, "--quiet", "--allow-existing", "--python", python, env], check=True)
    target = Path(
        subprocess.run(
            [f"{env}/bin/python", "-P", "-s", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    for site in map(Path, sites):
        for found in sorted(site.glob("*.dist-info")):
            if not (target / found.name).exists():
                shutil.copytree(found, target / found.name, symlinks=True)
    (target / NODE_PATH_FILE).write_text("".join(f"import site; site.addsitedir({site!r})\n" for site in sites))
    done = subprocess.run(
        [
            *(uv, "pip", "install", *common, "--python", f"{env}/bin/python", "--link-mode", "copy"),
            *("--no-build", "-r", requirements),  # wheels only: no package's build code runs here
        ]
    )
    return done.returncode


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as error:
        sys.exit(error.returncode or 1)
