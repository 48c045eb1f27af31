"""Fitted artifacts the strategies serve: the selector (``select``), the verifier (``answer_vote``), the learned
router (``route``) and the agreement cascade's thresholds (``cascade``). One artifact type (`artifact.Artifact`:
JSON only, written atomically, read once per file version) and one loader (`artifact.load_trained`); fitting them
is chorus/training/."""
