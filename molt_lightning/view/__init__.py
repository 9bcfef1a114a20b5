"""``molt view``: a run browser over run folders, from the curves down to each token (``server``: the app and the
command; ``pages``: what each page shows; ``runs``: the folders, their record indexed as it grows). Not imported by
``molt fit``: a front door of its own (scripts/size.py)."""
