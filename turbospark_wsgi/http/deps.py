"""An app's collaborators in its process: handed to create_app and carried by the app it builds,
never installed as process globals, so that two apps in one process keep their own.

    deps = AppDeps.build(config, early_refusal(config, service))   # what create_app does by default
    app = create_app(config, service, deps)     # starts the compute thread with deps.compute, deps.door
    deps_of(app) is deps                        # the worker's view of the app it loaded (self.wsgi)

Only the compute thread stays process-wide (one per process: serving/compute.py); it runs as the
app that starts it hands it (NOTE(one-thread)). Kept apart from app.py so that the gunicorn master,
which imports the workers, does not import the app's routes, service and engine.
"""
from dataclasses import dataclass

import falcon

from .. import metrics
from ..serving.compute import ComputeSettings, FrontDoor
from .refusal import EarlyRefusal


@dataclass(frozen=True, slots=True)
class AppDeps:
    """`compute`: how the compute thread that the app starts runs (its nice level, whether it gives
    way). `door`: the FrontDoor that the worker's loop claims while it answers a burst, and that
    the compute thread waits at between layers; its waits go to the metrics. `refusal`: the
    EarlyRefusal that the worker answers a full server's 503 (and a body's 413) with from the
    request head; None: every request goes to the app."""

    compute: ComputeSettings
    door: FrontDoor
    refusal: EarlyRefusal | None = None

    @classmethod
    def build(cls, config, refusal=None):
        """An app's own from `config`, with `refusal` (app.early_refusal)."""
        return cls(ComputeSettings.from_config(config), FrontDoor(on_wait=metrics.record_front_door_wait), refusal)


class AppWithDeps(falcon.App):
    """falcon.App with the AppDeps it was built with, where the server that loads it finds them."""

    def __init__(self, deps, **options):
        super().__init__(**options)
        self.deps = deps


_WRAPPED = ("__wrapped__", "app", "application")    # what WSGI middleware commonly names the app it wraps
_MAX_WRAPPERS = 8           # a deeper chain (or a loop) is taken for no app of ours


def deps_of(wsgi):
    """The AppDeps of a WSGI app that create_app built, seen through middleware that names what it
    wraps (`__wrapped__`, `app`, `application`); None for any other app."""
    for _ in range(_MAX_WRAPPERS):
        deps = getattr(wsgi, "deps", None)
        if isinstance(deps, AppDeps):
            return deps
        wsgi = next((inner for inner in (getattr(wsgi, name, None) for name in _WRAPPED) if inner is not None), None)
        if wsgi is None:
            return None
    return None
