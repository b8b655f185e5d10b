"""PDGroup as a kind the loop runs (P/D-Serve §3.2-3.4): :class:`.controller.PDGroups`."""

from matrixserve.handlers.pdgroup.controller import PDGroups

__all__ = ["PDGroups"]
