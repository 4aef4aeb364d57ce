"""The error tree: codes, builtin bases, messages and the backend-error boundary."""

from __future__ import annotations

import pickle

import pytest

import aioep
from aioep._base.errors import translate_backend_error


@pytest.mark.parametrize(
    ("cls", "builtin", "code"),
    [
        (aioep.InvalidArgument, ValueError, aioep.ErrorCode.INVALID_ARGUMENT),
        (aioep.NoSuchFile, FileNotFoundError, aioep.ErrorCode.NO_SUCHFILE),
        (aioep.NotImplementedByEp, NotImplementedError, aioep.ErrorCode.NOT_IMPLEMENTED),
        (aioep.InUseError, RuntimeError, aioep.ErrorCode.FAIL),
        (aioep.ClosedError, RuntimeError, aioep.ErrorCode.FAIL),
        (aioep.DeviceError, RuntimeError, aioep.ErrorCode.EP_FAIL),
    ],
)
def test_subclasses_derive_from_builtin_and_carry_code(
    cls: type[aioep.EpError], builtin: type[BaseException], code: aioep.ErrorCode
) -> None:
    err = cls("thing 'x' was wrong: 3")
    assert isinstance(err, aioep.EpError)
    assert isinstance(err, builtin)
    assert err.code is code
    assert str(err) == "thing 'x' was wrong: 3"
    with pytest.raises(builtin, match="thing 'x'"):
        raise err


def test_code_can_be_overridden_and_orts_values() -> None:
    err = aioep.EpError("boom", code=aioep.ErrorCode.EP_FAIL)
    assert err.code is aioep.ErrorCode.EP_FAIL
    assert aioep.EpError("x").code is aioep.ErrorCode.FAIL
    # OrtErrorCode numbering.
    assert int(aioep.ErrorCode.INVALID_ARGUMENT) == 2
    assert int(aioep.ErrorCode.NO_SUCHFILE) == 3
    assert int(aioep.ErrorCode.NOT_IMPLEMENTED) == 9
    assert int(aioep.ErrorCode.EP_FAIL) == 11


def test_no_such_file_str_is_the_message() -> None:
    # FileNotFoundError's own __str__ would print "[Errno ...]": ours prints the message.
    err = aioep.NoSuchFile("plugin library '/x.so' does not exist")
    assert str(err) == "plugin library '/x.so' does not exist"
    assert err.code is aioep.ErrorCode.NO_SUCHFILE


def test_translate_backend_error() -> None:
    original = OSError("cudaErrorIllegalAddress")
    err = translate_backend_error(original, "sim stream 'sim:0/3' copy")
    assert isinstance(err, aioep.DeviceError)
    assert "sim stream 'sim:0/3' copy failed" in str(err)
    assert "OSError: cudaErrorIllegalAddress" in str(err)
    passthrough = aioep.InvalidArgument("bad")
    assert translate_backend_error(passthrough, "x") is passthrough


def test_errors_pickle() -> None:
    err = pickle.loads(pickle.dumps(aioep.InvalidArgument("bad value 7")))
    assert isinstance(err, aioep.InvalidArgument)
    assert str(err) == "bad value 7"
    coded = pickle.loads(pickle.dumps(aioep.EpError("lost", code=aioep.ErrorCode.EP_FAIL)))
    assert coded.code is aioep.ErrorCode.EP_FAIL
