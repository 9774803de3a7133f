# The one image of a distbelief deployment: the Dask scheduler, the workers and the API all run it
# (docker-compose.yml picks the command). Workers need the same code as the API: they unpickle its models.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY distbelief ./distbelief
COPY storage ./storage
COPY models ./models
COPY sandblaster ./sandblaster
COPY downpour ./downpour
COPY api ./api
# The dependencies include bokeh, which serves the Dask dashboard (port 8787) that the web dashboard links to.
RUN pip install . && rm -rf /src

# An unprivileged user owns the store volume.
RUN useradd --create-home --uid 10001 distbelief && mkdir -p /data/store && chown -R distbelief /data
USER distbelief
WORKDIR /home/distbelief
ENV DISTBELIEF_STORE=/data/store
VOLUME ["/data"]
EXPOSE 8000 8786 8787

HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD python -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:8000/api/health', timeout=4)" || exit 1

CMD ["distbelief", "serve", "--host", "0.0.0.0", "--port", "8000"]
