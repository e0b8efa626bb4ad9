// Drives headless chromium through a gpunode dashboard; used by
// tests/tests/e2e/dashboard.rs, which starts the network and the jobs.
//
//   node e2e.mjs URL PROVIDER_PEER_ID [--screenshots DIR]
//
// 1. Opens URL (the link `gpunode dashboard` printed) and checks that the page shows
//    the provider, a GPU plot with samples, a waiting job with its reason, and a receipt.
// 2. Prints "READY" and waits for a line on stdin: the test then frees the GPU.
// 3. Checks that the waiting job's new state reaches the page without a reload, and
//    prints one JSON line with what it measured. Any failed check exits 1 with a reason.
import puppeteer from "puppeteer-core";
import { createInterface } from "node:readline";
import { existsSync } from "node:fs";

const [url, providerId, ...rest] = process.argv.slice(2);
const shotsAt = rest.indexOf("--screenshots");
const shots = shotsAt >= 0 ? rest[shotsAt + 1] : null;
if (!url || !providerId) {
  console.error("usage: node e2e.mjs URL PROVIDER_PEER_ID [--screenshots DIR]");
  process.exit(2);
}
const executablePath = process.env.CHROMIUM
  || ["/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"].find(existsSync);
if (!executablePath) {
  console.error("no chromium found: run scripts/install-deps.sh (it installs Debian's chromium)");
  process.exit(2);
}

function fail(why) { console.error("FAIL: " + why); process.exit(1); }

const browser = await puppeteer.launch({
  executablePath,
  headless: true,
  // Root in CI and containers: chromium's own sandbox needs user namespaces it may not get.
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
});
const result = {};
try {
  const page = await browser.newPage();
  await page.setViewport({ width: 1280, height: 900 });
  const problems = [];
  page.on("pageerror", (e) => problems.push("page error: " + e.message));
  page.on("console", (m) => { if (m.type() === "error") problems.push("console: " + m.text()); });
  page.on("requestfailed", (r) => {
    if (!r.url().endsWith("/events")) problems.push("request failed: " + r.url());
  });
  const external = [];
  page.on("request", (r) => { if (!r.url().startsWith(new URL(url).origin)) external.push(r.url()); });

  const t0 = Date.now();
  await page.goto(url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => (document.body.dataset.loaded || "").includes("network"), { timeout: 15000 });
  result.first_paint_ms = await page.evaluate(() => {
    const p = performance.getEntriesByType("paint").find((e) => e.name === "first-contentful-paint");
    return p ? Math.round(p.startTime) : null;
  });
  result.loaded_ms = Date.now() - t0;
  if (new URL(page.url()).search.includes("token")) fail("the token stayed in the address bar");

  // The provider, in the network view.
  await page.waitForSelector(`#providers tr[data-peer="${providerId}"]`, { timeout: 20000 })
    .catch(() => fail("the network view does not list the provider " + providerId));
  const row = await page.$eval(`#providers tr[data-peer="${providerId}"]`, (tr) => tr.textContent);
  if (!row.includes("A100")) fail("the provider's row does not show its A100: " + row);

  // A plot with samples, on this machine's view.
  await page.goto(new URL("/#machine", url).href);
  await page.waitForFunction(() => {
    const plots = [...document.querySelectorAll("#gpus svg.plot")];
    return plots.some((s) => Number(s.dataset.samples) >= 2);
  }, { timeout: 20000 }).catch(() => fail("no GPU plot with two samples or more"));
  result.plot_samples = await page.$eval("#gpus svg.plot", (s) => Number(s.dataset.samples));
  if (shots) await page.screenshot({ path: `${shots}/dashboard-machine.png`, fullPage: true });

  // A waiting job with its reason.
  await page.goto(new URL("/#jobs", url).href);
  await page.waitForSelector('#my-jobs tr[data-state="waiting"] td.why', { timeout: 20000 })
    .catch(() => fail("no waiting job on the jobs view"));
  const waiting = await page.$eval('#my-jobs tr[data-state="waiting"]', (tr) => ({
    id: tr.dataset.job, why: tr.querySelector("td.why").textContent }));
  if (waiting.why.trim().length < 5) fail("the waiting job gives no reason");
  result.waiting_reason = waiting.why;
  if (shots) await page.screenshot({ path: `${shots}/dashboard-jobs.png`, fullPage: true });

  // A receipt, with both signatures checked.
  await page.goto(new URL("/#credits", url).href);
  await page.waitForSelector("#receipts tr[data-lease] td.sigs .chip.ok", { timeout: 20000 })
    .catch(() => fail("no verified receipt on the credits view"));
  result.receipts = await page.$$eval("#receipts tr[data-lease]", (rows) => rows.length);
  if (shots) await page.screenshot({ path: `${shots}/dashboard-credits.png`, fullPage: true });
  if (shots) {
    await page.goto(new URL("/#network", url).href);
    await page.waitForSelector(`#providers tr[data-peer="${providerId}"]`);
    await page.screenshot({ path: `${shots}/dashboard-network.png`, fullPage: true });
    await page.goto(new URL("/#utilization", url).href);
    await page.screenshot({ path: `${shots}/dashboard-utilization.png`, fullPage: true });
  }

  // Live: the test frees the GPU; the job's new state must arrive without a reload.
  await page.goto(new URL("/#jobs", url).href);
  await page.waitForSelector(`#my-jobs tr[data-job="${waiting.id}"]`);
  await page.waitForFunction(() => document.getElementById("live").textContent === "live", { timeout: 10000 })
    .catch(() => fail("the live-update stream did not connect"));
  const marker = await page.evaluate(() => { window.e2eMarker = Math.random(); return window.e2eMarker; });
  console.log("READY");
  const lines = createInterface({ input: process.stdin });
  await new Promise((resolve) => lines.once("line", resolve));
  const freed = Date.now();
  await page.waitForFunction((id) => {
    const tr = document.querySelector(`#my-jobs tr[data-job="${id}"]`);
    return tr && tr.dataset.state !== "waiting";
  }, { timeout: 30000 }, waiting.id).catch(() => fail("the job's new state did not reach the page"));
  result.update_ms = Date.now() - freed;
  const same = await page.evaluate((m) => window.e2eMarker === m, marker);
  if (!same) fail("the page reloaded instead of updating");
  result.state_after = await page.$eval(`#my-jobs tr[data-job="${waiting.id}"]`, (tr) => tr.dataset.state);
  if (external.length) fail("the page fetched from elsewhere: " + external.join(", "));
  if (problems.length) fail(problems.join("; "));
  console.log(JSON.stringify(result));
} finally {
  await browser.close();
}
