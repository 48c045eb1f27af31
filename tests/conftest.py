"""Fixtures for the whole suite, and the markers of its folders: every test under tests/integration is marked
``integration`` and every test under tests/gpu ``gpu`` at collection, so ``-m "not integration"`` leaves out
exactly the tests that load real models. Shared helpers live in tests/helpers.py."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.helpers import LiveServer, gateway

HERE = Path(__file__).parent
#: the Batch API's store of servers tests start as processes without a ``server.batches.dir``: never the user's
#: $CHORUS_HOME/batches, whose batches a test's fakes would run (in-process apps get one each: helpers.gateway;
#: a test whose process uses the Batch API gives it its own)
os.environ["CHORUS_BATCH_DIR"] = tempfile.mkdtemp(prefix="chorus-test-batches-")
atexit.register(shutil.rmtree, os.environ["CHORUS_BATCH_DIR"], ignore_errors=True)
FOLDER_MARKS = {"integration": pytest.mark.integration, "gpu": pytest.mark.gpu}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            folder = Path(item.path).relative_to(HERE).parts[0]
        except ValueError:
            continue
        if folder in FOLDER_MARKS:
            item.add_marker(FOLDER_MARKS[folder])


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., LiveServer]]:
    """The fixture form of `helpers.gateway`: ``start_gateway(config, engines, **app_options)`` starts a live
    gateway that stops when the test ends."""
    with ExitStack() as stack:
        yield lambda *args, **kwargs: stack.enter_context(gateway(*args, **kwargs))
