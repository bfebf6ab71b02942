"""The controller's HTTP API, approval page and Prometheus metrics (``pip install
'replicheck[http,metrics]'``). Importing this package needs FastAPI; the controller core
does not."""

from replicheck.controller.http.app import ApiError, HttpConfig, create_app
from replicheck.controller.http.auth import Authenticator, Principal, Role, Token, read_token_file
from replicheck.controller.http.server import BackgroundServer, ServerLimits, parse_address

__all__ = [
    "ApiError",
    "Authenticator",
    "BackgroundServer",
    "HttpConfig",
    "Principal",
    "Role",
    "ServerLimits",
    "Token",
    "create_app",
    "parse_address",
    "read_token_file",
]
