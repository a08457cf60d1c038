import pytest, uuid
from bcp.backends import backend_for
from bcp.conformance import BackendContractTests
from conftest import new_bucket, store_uri

@pytest.fixture(scope="module")
def bucket(moto_server):
    return new_bucket(moto_server)

class TestMoto(BackendContractTests):
    @pytest.fixture
    def backend(self, moto_server, bucket):
        b = backend_for(store_uri("moto", moto_server, bucket, uuid.uuid4().hex))
        yield b

@pytest.fixture(scope="module")
def gbucket(gcs_server):
    return new_bucket(gcs_server)

class TestGcs(BackendContractTests):
    @pytest.fixture
    def backend(self, gcs_server, gbucket):
        b = backend_for(store_uri("gcs", gcs_server, gbucket, uuid.uuid4().hex, part_size="256KiB", conditional_writes="false"))
        yield b

@pytest.fixture(scope="module")
def rbucket(rclone_server):
    return new_bucket(rclone_server)

class TestRclone(BackendContractTests):
    @pytest.fixture
    def backend(self, rclone_server, rbucket):
        b = backend_for(store_uri("rclone", rclone_server, rbucket, uuid.uuid4().hex))
        yield b
