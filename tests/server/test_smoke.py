import httpx

from tests.conftest import ServerProcess


def test_health_and_models(server: ServerProcess, http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert ids == ["smollm2"]
