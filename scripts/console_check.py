#!/usr/bin/env python3
"""Drives the operator console (/console/ on the admin listener) in a real
headless Chromium through Playwright, against a running `bulkhead serve`, as an
operator would. Usage:

  console_check.py ADMIN_URL INFERENCE_URL ADMIN_TOKEN TENANT_KEY MODEL_ID PLUGIN_WASM OUT_DIR GGUF

TENANT_KEY is any tenant's key (it must not open the console); GGUF, a model
file the steps add as a second model and remove again. Chromium is the
system one (BULKHEAD_CHROMIUM, default /usr/bin/chromium): nothing is
downloaded. Each step saves a screenshot into OUT_DIR. Prints "ok" and exits 0
when every step passed; exits 3 when Playwright or Chromium is missing."""

import json
import os
import sys
import time
import urllib.error
import urllib.request

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:
    print("playwright is not installed (pip install -r scripts/requirements.txt)")
    sys.exit(3)

CHROMIUM = os.environ.get("BULKHEAD_CHROMIUM", "/usr/bin/chromium")
HOSTILE = '<img src=x onerror="window.__pwned=1">'
TIMEOUT_MS = 60_000


def chat(inference: str, key: str, model: str) -> int:
    """A chat completion with `key`; its HTTP status."""
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
    }).encode()
    request = urllib.request.Request(
        inference + "/v1/chat/completions", data=body, method="POST",
        headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def main() -> None:
    admin, inference, token, tenant_key, model, plugin, out, gguf = sys.argv[1:9]
    if not os.path.exists(CHROMIUM):
        print(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set BULKHEAD_CHROMIUM)")
        sys.exit(3)
    os.makedirs(out, exist_ok=True)
    console = admin + "/console/"
    origin = admin.rstrip("/")
    foreign = []
    problems = []

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        context.set_default_timeout(TIMEOUT_MS)
        # Assertions wait as long as actions: on a loaded machine (CI runs
        # the other suites beside this one) 5 s is not enough for an answer.
        expect.set_options(timeout=TIMEOUT_MS)
        page = context.new_page()
        # The console asks nothing of any origin but its own.
        page.on("request", lambda r: None if r.url.startswith(origin) or r.url.startswith("blob:")
                else foreign.append(r.url))
        # A CSP violation or a script error shows up here.
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" and "401" not in m.text
                and "404" not in m.text and "409" not in m.text and "400" not in m.text else None)
        page.on("pageerror", lambda e: problems.append(str(e)))

        def shot(name: str) -> None:
            page.screenshot(path=os.path.join(out, f"{name}.png"), full_page=True)

        def step(name: str) -> None:
            print(f"step: {name}", flush=True)

        try:
            run(page, console, token, tenant_key, model, plugin, inference, gguf, shot, step)
        except Exception:
            # What the page showed when it failed, for whoever reads the log.
            page.screenshot(path=os.path.join(out, "failed.png"), full_page=True)
            print("page at failure:", page.url, "\n", page.locator("body").inner_text(), flush=True)
            raise
        browser.close()

    assert not foreign, f"requests to other origins: {foreign}"
    assert not problems, f"errors in the page: {problems}"
    print("ok")


def run(page, console, token, tenant_key, model, plugin, inference, gguf, shot, step) -> None:
    """The steps, in order; each leaves a screenshot."""

    # 1. A wrong token and a tenant key are refused, in words.
    step("sign in refused")
    page.goto(console)
    for wrong in ("not-the-admin-token", tenant_key):
        page.fill("input[name=token]", wrong)
        page.click("button[type=submit]")
        expect(page.get_by_test_id("sign-in-error")).to_contain_text("did not accept the admin token")
    assert page.evaluate("sessionStorage.getItem('bulkhead.admin_token')") is None
    shot("01-sign-in-refused")

    # 2. The admin token opens it; the token is in session storage only.
    step("sign in")
    page.fill("input[name=token]", token)
    page.click("button[type=submit]")
    expect(page.get_by_test_id("models")).to_contain_text(model)
    assert page.evaluate("sessionStorage.getItem('bulkhead.admin_token')") == token
    assert page.evaluate("document.cookie") == ""
    assert token not in page.url

    # 3. A tenant, created through the form.
    step("create tenant")
    page.goto(console + "#/tenants")
    form = page.get_by_test_id("create-tenant")
    form.locator("input[name=name]").fill("delta")
    form.locator("input[name=pages_reserved]").fill("16")
    form.locator("input[name=pages_max]").fill("96")
    form.locator("button[type=submit]").click()
    expect(page.locator("h1")).to_have_text("Tenant “delta”")
    expect(page.get_by_test_id("notice")).to_contain_text("created")
    shot("02-tenant-created")

    # 4. A key, its secret shown once.
    step("issue key")
    page.get_by_test_id("issue-key").click()
    secret = page.get_by_test_id("secret-value").inner_text().strip()
    assert len(secret) > 20, secret
    expect(page.get_by_test_id("keys").locator("tbody tr")).to_have_count(1)
    shot("03-key-issued")

    # 5. The overview, open while the key is used: its tokens and the
    #    request appear without a reload.
    step("overview live")
    page.goto(console + "#/overview")
    row = page.get_by_test_id("models").locator(f"tr[data-model='{model}']")
    expect(row).to_be_visible()
    before = int(row.get_by_test_id("requests-10min").inner_text().replace(",", ""))
    navigations = []
    page.on("framenavigated", lambda f: navigations.append(f.url) if f == page.main_frame else None)
    assert chat(inference, secret, model) == 200
    deadline = time.time() + 30
    while time.time() < deadline:
        requests = int(row.get_by_test_id("requests-10min").inner_text().replace(",", ""))
        if requests > before:
            break
        page.wait_for_timeout(250)
    else:
        raise AssertionError("the overview did not show the request")
    assert float(row.get_by_test_id("tokens-per-second").inner_text()) > 0
    assert row.get_by_test_id("ttft").inner_text() != "–"
    expect(page.get_by_test_id("partitions")).to_contain_text("delta")
    assert navigations == [], navigations
    shot("04-overview")

    # 6. Its usage, per tenant.
    step("usage")
    page.goto(console + "#/usage/delta")
    deadline = time.time() + 30
    while page.get_by_test_id("usage-requests").inner_text() == "0" and time.time() < deadline:
        page.wait_for_timeout(1000)
        page.reload()
    expect(page.get_by_test_id("usage-requests")).to_have_text("1")
    with page.expect_download() as download:
        page.get_by_test_id("csv").click()
    csv = open(download.value.path()).read().splitlines()
    assert csv[0].startswith("minute_utc,requests,prompt_tokens,completion_tokens"), csv
    assert len(csv) == 2 and csv[1].split(",")[1] == "1", csv
    shot("05-usage")

    # 7. A quota the capacity contract cannot hold: refused, in words.
    step("capacity refusal")
    page.goto(console + "#/tenants/delta")
    quota = page.get_by_test_id("quota")
    quota.locator("input[name=pages_reserved]").fill("0")
    quota.locator("input[name=pages_max]").fill("2")
    quota.locator("button[type=submit]").click()
    error = quota.get_by_test_id("error")
    expect(error).to_contain_text("capacity contract would break")
    expect(error.locator("tr.broken")).not_to_have_count(0)
    assert "{" not in error.locator("p").inner_text(), "raw JSON shown"
    shot("06-capacity-refused")

    # 8. A plugin: uploaded, listed, disabled.
    step("plugin")
    page.goto(console + "#/plugins/delta")
    upload = page.get_by_test_id("upload-plugin")
    upload.locator("input[name=name]").fill("cap")
    upload.locator("input[name=file]").set_input_files(plugin)
    upload.locator("button[type=submit]").click()
    plugin_row = page.get_by_test_id("plugins").locator("tr[data-plugin=cap]")
    expect(plugin_row).to_contain_text("enabled")
    page.get_by_test_id("disable-cap").click()
    expect(plugin_row).to_contain_text("disabled")
    expect(page.get_by_test_id("plugin-events")).to_contain_text("plugin.disable")
    shot("07-plugin-disabled")

    # 9. Markup in a name shows as text and runs nothing: in a refused
    #    create (the API echoes nothing, the console quotes the name) and
    #    in a page route naming it.
    step("markup as text")
    page.goto(console + "#/tenants")
    form = page.get_by_test_id("create-tenant")
    form.locator("input[name=name]").fill(HOSTILE)
    form.locator("button[type=submit]").click()
    expect(form.get_by_test_id("error")).to_contain_text(HOSTILE)
    page.goto(console + "#/tenants/" + HOSTILE.replace('"', "%22"))
    expect(page.get_by_test_id("error")).to_contain_text(HOSTILE)
    page.wait_for_timeout(500)
    assert page.locator("main img").count() == 0
    assert page.evaluate("window.__pwned") is None
    shot("08-markup-as-text")

    # 10. Revoked: the next request with the key is refused.
    step("revoke key")
    page.goto(console + "#/tenants/delta")
    page.locator("[data-testid^=revoke-]").click()
    page.get_by_test_id("confirm").get_by_role("button", name="Revoke").click()
    expect(page.get_by_test_id("keys")).to_contain_text("revoked")
    assert chat(inference, secret, model) == 401
    shot("09-key-revoked")

    # 11. Delete asks first and says what is in flight.
    step("delete tenant")
    page.get_by_test_id("delete-tenant").click()
    expect(page.get_by_test_id("confirm")).to_contain_text("0 of its requests are in flight")
    page.get_by_test_id("confirm").get_by_role("button", name="Delete tenant").click()
    expect(page.get_by_test_id("tenants")).not_to_contain_text("delta")

    # 12. The capacity table with the binding limit marked, and the audit
    #     log filtered to one tenant's key events.
    step("capacity and audit")
    page.goto(console + "#/capacity")
    expect(page.locator("tr.binding")).not_to_have_count(0)
    shot("10-capacity")
    page.goto(console + "#/audit")
    filters = page.get_by_test_id("audit-filters")
    filters.locator("input[name=tenant]").fill("delta")
    filters.locator("input[name=action]").fill("key.")
    filters.locator("button[type=submit]").click()
    audit = page.get_by_test_id("audit")
    expect(audit.locator("tbody tr")).to_have_count(2)
    expect(audit).to_contain_text("key.issue")
    expect(audit).to_contain_text("key.revoke")
    shot("11-audit")
    # Paging: older than the oldest match is an empty page; back again.
    page.get_by_test_id("older").click()
    expect(page.locator("main")).to_contain_text("No records match.")
    page.get_by_role("button", name="← Newer").click()
    expect(page.get_by_test_id("audit").locator("tbody tr")).to_have_count(2)

    # 13. A second model loaded through the form, its pool audited, then
    #     removed with a drain.
    step("models")
    page.goto(console + "#/models")
    add = page.get_by_test_id("add-model")
    add.locator("input[name=id]").fill("extra-q8")
    add.locator("input[name=path]").fill(gguf)
    add.locator("input[name=context_tokens]").fill("1024")
    add.locator("input[name=pool_pages]").fill("256")
    add.locator("input[name=threads]").fill("1")
    add.locator("button[type=submit]").click()
    expect(page.get_by_test_id("notice")).to_contain_text("extra-q8 loaded")
    page.get_by_test_id("audit-extra-q8").click()
    expect(page.get_by_test_id("models")).to_contain_text("at baseline")
    expect(page.get_by_test_id("models")).to_contain_text("invariants: ok")
    shot("12-models")
    page.get_by_test_id("remove-extra-q8").click()
    confirm = page.get_by_test_id("confirm")
    confirm.locator("input[name=drain]").fill("0")
    confirm.get_by_role("button", name="Remove model").click()
    expect(page.get_by_test_id("notice")).to_contain_text("extra-q8 removed")
    expect(page.get_by_test_id("models")).not_to_contain_text("extra-q8")

    # 14. 200 % zoom on a 1280x800 screen: 640x400 CSS pixels, and no page
    #     is wider than that (wide tables scroll inside themselves).
    step("zoom")
    page.set_viewport_size({"width": 640, "height": 400})
    for where in ("#/overview", "#/tenants", "#/capacity", "#/audit", "#/plugins/alpha"):
        page.goto(console + where)
        page.wait_for_selector("main h1")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 640, f"{where} is {width} px wide at 200 % zoom"
    page.goto(console + "#/overview")
    page.wait_for_selector("main h1")
    shot("13-overview-zoom-200")

    # 15. Sign out forgets the token.
    step("sign out")
    page.click("#sign-out")
    expect(page.get_by_test_id("sign-in")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('bulkhead.admin_token')") is None


if __name__ == "__main__":
    main()
