"""Pydantic v2 wire models shared by the server and its clients. No torch, no ORM."""

from .bounds import BoundReport, GrowthPoint, LayerBoundOut, Norm, Verdict, Witness

__all__ = ["BoundReport", "GrowthPoint", "LayerBoundOut", "Norm", "Verdict", "Witness"]
