#!/bin/bash
mv draft.txt final.txt
