"""Top-k routing: softmax top-k and sigmoid grouped top-k with correction bias."""

from sparkinfer.moe.routing.launch import route
from sparkinfer.moe.routing.reference import route_reference

__all__ = ["route", "route_reference"]
