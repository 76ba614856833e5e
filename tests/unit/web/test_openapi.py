"""The API's description is OpenAPI 3.1 and names exactly the API's routes and methods."""

from __future__ import annotations

import yaml
from openapi_spec_validator import validate
from starlette.routing import Route

from mailpipe.web.api import OPENAPI
from mailpipe.web.app import API


def spec() -> dict:  # type: ignore[type-arg]
    return dict(yaml.safe_load(OPENAPI.read_text()))


def test_the_description_is_openapi() -> None:
    validate(spec())


def test_the_description_names_every_route_and_method_of_the_api() -> None:
    described = {
        (method.upper(), path)
        for path, operations in spec()["paths"].items()
        for method in operations
        if method in ("get", "post", "put", "delete", "patch")
    }
    routed = {
        (method, route.path)
        for route in API
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"
    }
    assert described == routed
    assert spec()["servers"] == [{"url": "/api"}]
