/**
 * `StoreClient`: the operations on what the daemon keeps (images, snapshots, packs, pools of ready VMMs,
 * workspaces) and on the daemon itself; `Controller` adds the ones on running sandboxes. As in the Python SDK's
 * operations.py: same paths, defaults and timeouts.
 */

import { checkInt, checkKeys, checkName } from "./check.js";
import { Client, progress, seg } from "./client.js";
import { TimeoutError } from "./errors.js";
import { LONG_TIMEOUT_MS } from "./transport.js";
import type { JsonBody, Pool, SnapshotInfo, SnapshotListing, SnapshotOptions, Workspace } from "./types.js";

export type ImageSpec = JsonBody<"/v1/images", "post">;
export type PullRequest = JsonBody<"/v1/packs/pull", "post">;

const PULL_KEYS: Record<keyof PullRequest, true> = { url: true, sha256: true, index: true, name: true, tag: true, force: true };

export class StoreClient extends Client {
  // daemon

  async health(): Promise<{ ok: boolean }> {
    return this.request({ method: "GET", path: "/healthz" });
  }

  async version(): Promise<Record<string, unknown>> {
    return this.request({ method: "GET", path: "/v1/version" });
  }

  /** `[{name, status, detail, fix}]`: the daemon host's checks. */
  async doctor(): Promise<{ name: string; status: string; detail: string; fix: string }[]> {
    return (await this.request<{ checks: { name: string; status: string; detail: string; fix: string }[] }>(
      { method: "GET", path: "/v1/doctor" })).checks;
  }

  // images

  async images(): Promise<Record<string, unknown>[]> {
    return (await this.request<{ images: Record<string, unknown>[] }>({ method: "GET", path: "/v1/images" })).images;
  }

  /** Build (or reuse) a guest image; `onProgress` gets the progress lines. */
  async buildImage(spec: ImageSpec = {}, onProgress?: (line: string) => unknown): Promise<Record<string, unknown>> {
    return this.streamed({ method: "POST", path: "/v1/images", json: spec }, progress(onProgress));
  }

  async removeImage(name: string): Promise<void> {
    await this.request({ method: "DELETE", path: `/v1/images/${seg(checkName("image name", name))}` });
  }

  // snapshots

  async snapshots(): Promise<SnapshotListing[]> {
    return (await this.request<{ snapshots: SnapshotListing[] }>({ method: "GET", path: "/v1/snapshots" })).snapshots;
  }

  async snapshot(tag: string): Promise<SnapshotInfo> {
    return this.request({ method: "GET", path: `/v1/snapshots/${seg(checkName("tag", tag))}` });
  }

  /** Boot `options.image` (default image), warm it and save it as `tag`; `onProgress` gets the progress lines. */
  async createSnapshot(tag: string, options: SnapshotOptions = {}, onProgress?: (line: string) => unknown): Promise<SnapshotInfo> {
    const json = { tag: checkName("tag", tag), ...options };
    return this.streamed({ method: "POST", path: "/v1/snapshots", json }, progress(onProgress));
  }

  /** The tags removed (`cascade`: the snapshots branched from `tag` too; `force`: orphan them). */
  async removeSnapshot(tag: string, options: { cascade?: boolean; force?: boolean } = {}): Promise<string[]> {
    checkKeys("removeSnapshot", options, { cascade: true, force: true });
    const answer = await this.request<{ removed_tags: string[] }>({
      method: "DELETE", path: `/v1/snapshots/${seg(checkName("tag", tag))}`,
      query: { cascade: options.cascade ?? false, force: options.force ?? false },
    });
    return answer.removed_tags;
  }

  /** Poll until snapshot `tag` is no longer `writing` (a BRANCH with `wait: false`); answers it `ready` or `failed`. */
  async waitSnapshot(tag: string, options: { timeoutMs?: number; pollMs?: number } = {}): Promise<SnapshotInfo> {
    const deadline = Date.now() + (options.timeoutMs ?? 600_000);
    for (;;) {
      const info = await this.snapshot(tag);
      if (info.status !== "writing") return info;
      if (Date.now() > deadline) {
        throw new TimeoutError(504, "timeout", `snapshot ${tag} still writing after ${(options.timeoutMs ?? 600_000) / 1000} s`);
      }
      await new Promise((resolve) => setTimeout(resolve, options.pollMs ?? 200));
    }
  }

  /** Flatten `fromTag`'s chain into the standalone snapshot `toTag`. */
  async compact(fromTag: string, toTag: string): Promise<SnapshotInfo> {
    return this.request({ method: "POST", path: "/v1/snapshots/compact", timeoutMs: LONG_TIMEOUT_MS,
      json: { from_tag: checkName("from tag", fromTag), to_tag: checkName("to tag", toTag) } });
  }

  /** Run `cmd` in a child of `baseTag` and save what it changed as the diff snapshot `tag`. */
  async snapshotDiff(baseTag: string, tag: string, cmd: string, timeoutS = 600): Promise<SnapshotInfo> {
    return this.request({ method: "POST", path: "/v1/snapshots/diff", timeoutMs: (timeoutS + 60) * 1000,
      json: { base_tag: checkName("base tag", baseTag), tag: checkName("tag", tag), cmd, timeout_s: timeoutS } });
  }

  // packs (paths are on the daemon's host, inside its packs directory)

  /** Write snapshot `tag` and its ancestors to the pack file `path`. */
  async pack(tag: string, path: string, options: { force?: boolean; onProgress?: (line: string) => unknown } = {}):
  Promise<Record<string, unknown>> {
    return this.streamed({ method: "POST", path: "/v1/packs",
      json: { tag: checkName("tag", tag), path, force: options.force ?? false } }, progress(options.onProgress));
  }

  /** Register the snapshots of the pack file `path` (the top one as `tag` if given). */
  async unpack(path: string, options: { tag?: string; force?: boolean; onProgress?: (line: string) => unknown } = {}):
  Promise<SnapshotInfo> {
    const json = { path, force: options.force ?? false,
      ...(options.tag === undefined ? {} : { tag: checkName("tag", options.tag) }) };
    return this.streamed({ method: "POST", path: "/v1/packs/unpack", json }, progress(options.onProgress));
  }

  /** Download a pack (`url` + `sha256`, or `name` of an `index`), verify it and unpack it. */
  async pull(request: PullRequest, onProgress?: (line: string) => unknown): Promise<SnapshotInfo> {
    checkKeys("pull", request, PULL_KEYS);
    return this.streamed({ method: "POST", path: "/v1/packs/pull", json: request }, progress(onProgress));
  }

  /** Pack `tag` and upload it with one HTTP PUT to `url` (e.g. a presigned object-store URL). */
  async push(tag: string, url: string, onProgress?: (line: string) => unknown): Promise<Record<string, unknown>> {
    return this.streamed({ method: "POST", path: "/v1/packs/push", json: { tag: checkName("tag", tag), url } },
      progress(onProgress));
  }

  // pools of ready VMMs

  async pools(): Promise<Pool[]> {
    return (await this.request<{ pools: Pool[] }>({ method: "GET", path: "/v1/pools" })).pools;
  }

  async pool(tag: string): Promise<Pool> {
    return this.request({ method: "GET", path: `/v1/pools/${seg(checkName("tag", tag))}` });
  }

  /** Keep `size` ready VMMs of `tag` (0 - 32; 0: none), filled in the background. */
  async setPoolSize(tag: string, size: number): Promise<Pool> {
    return this.request({
      method: "PUT", path: `/v1/pools/${seg(checkName("tag", tag))}`, json: { size: checkInt("pool size", size, 0, 32) },
    });
  }

  // workspaces

  async createWorkspace(name: string, snapshotTag: string): Promise<Workspace> {
    return this.request({
      method: "POST", path: "/v1/workspaces", timeoutMs: LONG_TIMEOUT_MS,
      json: { name: checkName("workspace name", name), snapshot_tag: checkName("snapshot tag", snapshotTag) },
    });
  }

  async workspaces(): Promise<Workspace[]> {
    return (await this.request<{ workspaces: Workspace[] }>({ method: "GET", path: "/v1/workspaces" })).workspaces;
  }

  async workspace(name: string): Promise<Workspace> {
    return this.request({ method: "GET", path: `/v1/workspaces/${seg(checkName("workspace name", name))}` });
  }

  /** Save the workspace as its next diff layer and stop its sandbox (its memory is freed). */
  async suspendWorkspace(name: string): Promise<Workspace> {
    return this.workspaceAction(name, "suspend");
  }

  /** Start a child of the workspace's last layer as its new sandbox. */
  async resumeWorkspace(name: string): Promise<Workspace> {
    return this.workspaceAction(name, "resume");
  }

  /** Kill the workspace's sandbox and remove its layers; answers the tags removed. */
  async removeWorkspace(name: string): Promise<string[]> {
    const answer = await this.request<{ removed_tags: string[] }>({
      method: "DELETE", path: `/v1/workspaces/${seg(checkName("workspace name", name))}`, timeoutMs: LONG_TIMEOUT_MS,
    });
    return answer.removed_tags;
  }

  private async workspaceAction(name: string, action: "suspend" | "resume"): Promise<Workspace> {
    return this.request({
      method: "POST", path: `/v1/workspaces/${seg(checkName("workspace name", name))}/${action}`,
      timeoutMs: LONG_TIMEOUT_MS,
    });
  }
}
