"""Bad URLs are refused before any process starts, each with one line that names the argument, the path and the fix;
no message (each is checked) and no written file holds the secret key."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
from flair.models import TextClassifier

import flair_fabric
from flair_fabric import cli
from flair_fabric.storage import StorageError

from ..storage_server import BUCKET, KEY_ID, SECRET, S3Server
from ..support import REPO, small_trec, tiny_text_classifier

ONE = {"devices": 1, "accelerator": "cpu"}


@pytest.fixture
def model() -> TextClassifier:
    """An untrained classifier: a run that got past the checks would predict with it and write a file."""
    return tiny_text_classifier(small_trec())


def _refused(model: TextClassifier, data: str, out_path: str, **options: object) -> str:
    with pytest.raises(ValueError) as refused:
        flair_fabric.predict(model, data, out_path=out_path, **ONE, **options)  # type: ignore[arg-type]
    message = str(refused.value)
    assert "\n" not in message and SECRET not in message and KEY_ID not in message, message
    return message


ABSENT_CANDIDATES = (("az", "adlfs"), ("oci", "ocifs"), ("dropbox", "dropboxdrivefs"), ("box", "boxfs"))


def _absent_package_scheme() -> tuple[str, str]:
    """A scheme fsspec knows whose package (no extra of flair-fabric) is not installed here."""
    absent = [each for each in ABSENT_CANDIDATES if importlib.util.find_spec(each[1]) is None]
    assert absent, "every candidate's package is installed: add another candidate"
    return absent[0]


def _without_s3fs(url: str) -> str:
    """The message of ``check_reachable(url)`` in a Python where s3fs cannot be imported (``sys.modules["s3fs"] =
    None``, as for a package that is absent), run as a subprocess: this one has imported s3fs."""
    probe = (
        "import sys\nsys.modules['s3fs'] = None\nfrom flair_fabric.storage import StorageError, check_reachable\n"
        f"try:\n    check_reachable({url!r}, argument='data')\nexcept StorageError as error:\n    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_an_unknown_scheme_or_one_whose_package_is_absent_names_the_argument_and_the_fix(
    s3: S3Server, model: TextClassifier, tmp_path: Path
) -> None:
    message = _refused(model, "nosuch://bucket/in.txt", str(tmp_path / "out.jsonl"))
    assert message.startswith("data='nosuch://bucket/in.txt': unknown URL scheme nosuch://; fsspec knows:")
    assert " s3, " in message and " memory, " in message
    scheme, package = _absent_package_scheme()
    fix = f"{scheme}:// needs {package}, which is not installed: pip install {package}."
    message = _refused(model, f"{scheme}://bucket/in.txt", str(tmp_path / "out.jsonl"))
    assert message == f"data='{scheme}://bucket/in.txt': {fix}"
    fsspec.filesystem("s3").pipe(f"s3://{BUCKET}/bad/in.txt", b"what is this\n")
    message = _refused(model, f"s3://{BUCKET}/bad/in.txt", f"{scheme}://bucket/out.jsonl")
    assert message == f"out_path='{scheme}://bucket/out.jsonl': {fix}"
    assert _without_s3fs("s3://bucket/in.txt") == (
        "data='s3://bucket/in.txt': s3:// needs s3fs, which is not installed: pip install flair-fabric[s3]."
    )
    if importlib.util.find_spec("gcsfs") is None:  # the dev extras do not install it (else: the case above only)
        message = _refused(model, "gs://bucket/in.txt", str(tmp_path / "out.jsonl"))
        assert (
            message
            == "data='gs://bucket/in.txt': gs:// needs gcsfs, which is not installed: pip install flair-fabric[gcs]."
        )
    assert not list(tmp_path.iterdir())


def test_a_missing_bucket_file_or_an_empty_file_is_refused_before_any_process_starts(
    s3: S3Server, model: TextClassifier, tmp_path: Path
) -> None:
    fs = fsspec.filesystem("s3")
    fs.pipe(f"s3://{BUCKET}/bad/in.txt", b"what is this\n")
    fs.pipe(f"s3://{BUCKET}/bad/empty.txt", b"")
    out = str(tmp_path / "out.jsonl")
    assert _refused(model, "s3://no-such-bucket/in.txt", out) == "data='s3://no-such-bucket/in.txt': no such file."
    assert (
        _refused(model, f"s3://{BUCKET}/bad/absent.txt", out) == f"data='s3://{BUCKET}/bad/absent.txt': no such file."
    )
    assert _refused(model, f"s3://{BUCKET}/bad/empty.txt", out).endswith("is empty: there is nothing to predict.")
    assert (
        _refused(model, f"s3://{BUCKET}/bad", out)
        == f"data='s3://{BUCKET}/bad' is not a file: pass the URL of an existing file."
    )
    message = _refused(model, f"s3://{BUCKET}/bad/in.txt", "s3://no-such-bucket/out/out.jsonl")
    assert message == (
        "out_path='s3://no-such-bucket/out/out.jsonl': no-such-bucket does not exist (bucket or folder):"
        " create it first."
    )
    assert fs.ls(f"{BUCKET}/bad", refresh=True) == [f"{BUCKET}/bad/empty.txt", f"{BUCKET}/bad/in.txt"]
    with pytest.raises(SystemExit) as ended:  # the command line checks before it loads the model
        cli.main(["predict", "--model", "never.pt", "--input", f"s3://{BUCKET}/bad/absent.txt", "--output", out])
    assert str(ended.value) == f"--input='s3://{BUCKET}/bad/absent.txt': no such file."
    with pytest.raises(SystemExit) as ended:
        cli.main(["predict", "--model", "never.pt", "--input", "in.txt", "--output", "s3://no-such-bucket/o.jsonl"])
    assert str(ended.value).startswith("--output='s3://no-such-bucket/o.jsonl': no-such-bucket does not exist")


def test_no_credentials_is_one_line_naming_the_path_and_the_fix_and_storage_options_pass_them(
    s3: S3Server, model: TextClassifier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsspec.filesystem("s3").pipe(f"s3://{BUCKET}/creds/in.txt", b"what is this\nwhat is that\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    message = _refused(model, f"s3://{BUCKET}/creds/in.txt", str(tmp_path / "out.jsonl"))
    assert message == (
        f"data='s3://{BUCKET}/creds/in.txt': no credentials found: set the provider's variables (AWS_ACCESS_KEY_ID,"
        " ...) or pass storage_options."
    )
    options = {"key": KEY_ID, "secret": SECRET}
    message = _refused(model, "s3://no-such-bucket/in.txt", str(tmp_path / "out.jsonl"), storage_options=options)
    assert message == "data='s3://no-such-bucket/in.txt': no such file."
    summary = flair_fabric.predict(
        model, f"s3://{BUCKET}/creds/in.txt", out_path=f"s3://{BUCKET}/creds/out.jsonl", storage_options=options, **ONE
    )
    assert summary.predicted == 2
    written = s3fs.S3FileSystem(**options).cat(f"s3://{BUCKET}/creds/out.jsonl")
    assert written.count(b"\n") == 2 and SECRET.encode() not in written
    with pytest.raises(StorageError) as refused:  # a provider's message is blanked where it holds a secret
        from flair_fabric.storage import _unreachable

        raise StorageError(_unreachable("s3://b/x", "data", PermissionError(f"denied for {SECRET}"), options))
    assert str(refused.value) == (
        "data='s3://b/x': access denied (denied for ***): check the credentials and the bucket's permissions."
    )
