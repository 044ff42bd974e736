"""``spec.router``: routing through the Gateway API Inference Extension — an InferencePool of
the replicas' leader pods, picked per request by an endpoint picker (EPP) that reads the
engines' queue and KV-cache usage, and optionally an HTTPRoute from a Gateway to the pool."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from brook_engine.config import Section
from brook_operator.api.kube import DNS_LABEL, DNS_SUBDOMAIN

#: The Inference Extension's API (v1, GA) and the Gateway API's.
INFERENCE_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_API = f"{INFERENCE_GROUP}/v1"
GATEWAY_GROUP = "gateway.networking.k8s.io"
HTTP_ROUTE_API = f"{GATEWAY_GROUP}/v1"


class EndpointPickerRef(Section):
    """The endpoint picker's Service, in the resource's namespace."""

    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL)
    """Service name of the EPP (installed with the Inference Extension's chart)."""

    port: int = Field(default=9002, ge=1, le=65535)
    """Its ext-proc (gRPC) port."""

    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"
    """When the picker does not answer: refuse the request (FailClose) or send it to any
    replica (FailOpen)."""


class GatewayRef(Section):
    """A Gateway the route attaches to."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    """Gateway name."""

    namespace: str | None = Field(default=None, max_length=63, pattern=DNS_LABEL)
    """Its namespace (default: the resource's); the Gateway must allow routes from here."""

    section_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN)
    """One listener of the Gateway (default: all that admit the route)."""


class RouterSpec(Section):
    """Inference-aware routing: an InferencePool named after the resource (its leader pods on
    ``server.port``), and with ``gateways`` an HTTPRoute sending every path to it."""

    endpoint_picker: EndpointPickerRef
    """The endpoint picker that chooses a replica per request."""

    gateways: list[GatewayRef] = Field(default_factory=list, max_length=8)
    """Gateways to route from (none: the pool only, for routes of your own)."""

    hostnames: list[str] = Field(default_factory=list, max_length=16)
    """Host names the route matches (none: every host the Gateway admits)."""
