"""A backend used only by Lite's tests; its modules are imported only when a test asks for them."""
