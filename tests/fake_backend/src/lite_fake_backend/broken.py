"""`strategy="fake_broken"`: a backend module that cannot be imported."""

raise ImportError("simulated broken backend")
