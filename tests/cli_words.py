"""Errors as the command line words them: ``pytest.raises`` matched against the message with its hints in flags."""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

import pytest

from cabinllm.cli.args import cli_message


@contextmanager
def raises_in_cli_words(kind: type[BaseException], match: str) -> Iterator[pytest.ExceptionInfo]:
    """``pytest.raises(kind)``, then ``match`` searched in the error as a command prints it."""
    with pytest.raises(kind) as caught:
        yield caught
    assert re.search(match, cli_message(caught.value)), cli_message(caught.value)
