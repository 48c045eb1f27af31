"""The browser playground: static files (HTML, CSS, ES modules) and the route that serves them."""
