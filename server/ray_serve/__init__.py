"""Octavo on Ray Serve: engine replicas behind one OpenAI endpoint (`octavo serve --ray`)."""
