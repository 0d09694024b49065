"""A publisher and a claim reader wired to the in-memory API server (fakeapi.FakeApi)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from lightkube import KubeConfig
from lightkube.config.models import Cluster, User

from plugvisor.dra.kube.claims import ClaimReader
from plugvisor.dra.kube.config import ApiConfig, api_client
from plugvisor.dra.kube.slices import SlicePublisher

from .fakeapi import FakeApi

DRIVER = "gpu.plugvisor.io"
NODE = "node-a"


def fake_config() -> ApiConfig:
    return ApiConfig(
        KubeConfig.from_one(cluster=Cluster(server="https://api.test"), user=User(token="t")), "test"
    )


@pytest.fixture
def api() -> FakeApi:
    return FakeApi(node=NODE)


@pytest.fixture
async def publisher(api: FakeApi) -> AsyncIterator[SlicePublisher]:
    client = api_client(fake_config(), transport=api.transport)
    publisher = SlicePublisher(
        client, driver=DRIVER, node=NODE, resync_delay=0.01, backoff_initial=0.01, backoff_max=0.05
    )
    yield publisher
    await publisher.close()
    await client.close()


@pytest.fixture
async def claims(api: FakeApi) -> AsyncIterator[ClaimReader]:
    client = api_client(fake_config(), transport=api.transport)
    yield ClaimReader(client, timeout=0.2, backoff_initial=0.01)
    await client.close()
