# The plugvisor image: one entry point, the `plugvisor` command.
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir . && rm -rf /src
WORKDIR /
ENTRYPOINT ["plugvisor"]
